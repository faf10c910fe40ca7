"""Runs the embedded engine server in this process (what `loongsage engine` calls)."""
from __future__ import annotations

import logging
import os
import sys

import torch

from loongsage.cluster.network import is_loopback
from loongsage.engine.config import EngineConfig
from loongsage.engine.core import EngineCore
from loongsage.engine.security import API_KEY_ENV, EngineSecurity
from loongsage.engine.server import create_app, release
from loongsage.heap import freeze_long_lived
from loongsage.http_server import run_server


def serve(model: str, host: str, port: int, cfg: EngineConfig, log_level: str = "warning",
          security: EngineSecurity | None = None) -> None:
    security = security or EngineSecurity()
    if not is_loopback(host) and not security.api_key:
        print(f"warning: the engine listens on {host} without an API key: anyone who can reach it can generate, "
              f"load weights and pause it; set --api-key (or {API_KEY_ENV})", file=sys.stderr, flush=True)
    if cfg.cpu_affinity and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cfg.cpu_affinity)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    core = EngineCore(
        model, dtype=cfg.dtype, device=cfg.device, max_running=cfg.max_running,
        context_length=cfg.context_length, max_prefill_tokens=cfg.max_prefill_tokens,
        weight_version=cfg.weight_version, enable_prefix_cache=cfg.prefix_cache,
        prefix_cache_min_tokens=cfg.prefix_cache_min_tokens,
    )
    app = create_app(core, security=security, host=host, inject_errors=cfg.inject_errors)
    freeze_long_lived()  # model, tokenizer, server: out of the cyclic GC's full passes (heap.py)
    core.start()
    print(f"loongsage engine (pid {os.getpid()}): {model} on {host}:{port}, device {cfg.device}, "
          f"{torch.get_num_threads()} threads, max_running {cfg.max_running}, context {cfg.context_length}",
          file=sys.stderr, flush=True)  # the first line of its log: which server this was
    try:
        run_server(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                   timeout_keep_alive=60)  # well above clients' idle keep-alive (see rollout/client.py)
    finally:
        release(app)
        core.shutdown()
