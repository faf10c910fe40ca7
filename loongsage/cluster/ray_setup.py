"""Starts a local Ray instance bound to 127.0.0.1 (no dashboard, no token auth) or joins one."""
from __future__ import annotations

import os

# Must be set before `import ray`: keeps a local instance on loopback and off token auth (PROBES.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402

from loongsage.cluster.config import RayConfig  # noqa: E402


def init_ray(cfg: RayConfig | None = None) -> bool:
    """Returns True when this call started Ray (so the caller shuts it down)."""
    cfg = cfg or RayConfig()
    if ray.is_initialized():
        return False
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}}
    if cfg.address:
        ray.init(address=cfg.address, runtime_env=env, log_to_driver=cfg.log_to_driver)
    else:
        ray.init(num_cpus=cfg.num_cpus or os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
                 runtime_env=env, log_to_driver=cfg.log_to_driver, configure_logging=False)
    return True
