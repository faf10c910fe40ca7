"""Starts a local Ray instance bound to 127.0.0.1 (no dashboard) or joins a cluster.

Ray decides between loopback and the machine's address from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER, read
once at `import ray`; the package entry sets it, and `init_ray` sets the constant it became as well,
so a program that imported Ray before LoongSage still gets a loopback-only local instance. Ray's
token authentication stays on (its default; the token lives in ~/.ray/auth_token): a local process
of another user that reaches a loopback port still cannot drive the cluster.

A local instance also leaves out three of Ray's helper processes that a single run never uses: the
autoscaler monitor (a local instance's resources are fixed), the log monitor unless the run sends
worker logs to the driver (the logs are still written to the session folder), and the API server
that `include_dashboard=False` still starts (it serves the dashboard, job submission and the state
API). Each is a Python process importing Ray on a machine of a few cores; together they took
4.4 -> 2.2 s off a local `ray.init` on two cores. `ray.init` has no argument for them, so
`_lean_local_head` sets them on Ray's node parameters for the one call, and leaves Ray as it was
when this Ray version lacks the names (the instance then starts with them, as before).
"""
from __future__ import annotations

import contextlib
import os

import ray
from ray._private import node as ray_node
from ray._private import parameter as ray_parameter
from ray._private import ray_constants

from loongsage.cluster.config import RayConfig

WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false"}  # every actor's: tokenizers in processes that fork


def _expose(local: bool) -> None:
    """Loopback only for a local instance; the node's own address for a cluster."""
    ray_constants.ENABLE_RAY_CLUSTER = not local
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0" if local else "1"  # Ray's own child processes


@contextlib.contextmanager
def _lean_local_head(log_to_driver: bool):
    """Ray's head without its autoscaler monitor, API server and (unless `log_to_driver`) log monitor,
    for the calls made inside; Ray's own functions are back in place afterwards."""
    params_init = getattr(ray_parameter.RayParams, "__init__", None)
    start_api_server = getattr(ray_node.Node, "start_api_server", None)
    known = params_init is not None and start_api_server is not None and {"no_monitor", "include_log_monitor"} <= set(
        params_init.__code__.co_varnames)
    if not known:  # another Ray: start its usual processes
        yield
        return

    def lean_params(self, *args, **kwargs):
        params_init(self, *args, **kwargs)
        self.no_monitor = True
        self.include_log_monitor = log_to_driver

    ray_parameter.RayParams.__init__ = lean_params
    ray_node.Node.start_api_server = lambda self, **_: None
    try:
        yield
    finally:
        ray_parameter.RayParams.__init__ = params_init
        ray_node.Node.start_api_server = start_api_server


def init_ray(cfg: RayConfig | None = None) -> bool:
    """Returns True when this call started Ray (so the caller shuts it down)."""
    cfg = cfg or RayConfig()
    if ray.is_initialized():
        return False
    _expose(local=not cfg.address)
    if cfg.address:
        ray.init(address=cfg.address, runtime_env={"env_vars": dict(WORKER_ENV)}, log_to_driver=cfg.log_to_driver)
        return True
    # A local instance's workers inherit the environment Ray's processes start with: a runtime_env
    # would route every actor through Ray's setup_worker and its env agent (~1.3 s an actor here).
    saved = {k: os.environ.get(k) for k in WORKER_ENV}
    os.environ.update(WORKER_ENV)
    try:
        with _lean_local_head(cfg.log_to_driver):
            ray.init(num_cpus=cfg.num_cpus or os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
                     log_to_driver=cfg.log_to_driver, configure_logging=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return True
