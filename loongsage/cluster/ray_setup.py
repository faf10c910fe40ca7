"""Starts a local Ray instance bound to 127.0.0.1 (no dashboard) or joins a cluster.

Ray decides between loopback and the machine's address from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER, read
once at `import ray`; the package entry sets it, and `init_ray` sets the constant it became as well,
so a program that imported Ray before LoongSage still gets a loopback-only local instance. Ray's
token authentication stays on (its default; the token lives in ~/.ray/auth_token): a local process
of another user that reaches a loopback port still cannot drive the cluster.
"""
from __future__ import annotations

import os

import ray
from ray._private import ray_constants

from loongsage.cluster.config import RayConfig

WORKER_ENV = {"TOKENIZERS_PARALLELISM": "false"}  # every actor's: tokenizers in processes that fork


def _expose(local: bool) -> None:
    """Loopback only for a local instance; the node's own address for a cluster."""
    ray_constants.ENABLE_RAY_CLUSTER = not local
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0" if local else "1"  # Ray's own child processes


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
        ray.init(num_cpus=cfg.num_cpus or os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=cfg.log_to_driver, configure_logging=False)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return True
