"""Inference engines as Ray actors: each launches one server (embedded engine, or SGLang on GPU)
on a free port of its node's own address, waits for `/health`, and owns the process's lifetime.
The group's engines share one random API key (every route but /health needs it), read shared-memory
weights only under the run's prefix, and load weights from disk only below the given folders."""
from __future__ import annotations

import secrets

import ray

from loongsage.cluster.actors import stop_actors
from loongsage.engine.config import EngineConfig
from loongsage.rollout.config import RolloutConfig
from loongsage.transfer.shm_names import SHM_PREFIX


class EngineActor:
    def __init__(self, model_path: str, ecfg: EngineConfig, threads: int, kind: str, api_key: str, shm_prefix: str,
                 weight_roots: list[str], log_path: str | None = None):
        from loongsage.cliargs import flags_of
        from loongsage.cluster.network import node_address
        from loongsage.rollout.launcher import launch_engine, launch_sglang
        from loongsage.transfer.devices import physical_device

        self.device = physical_device("cuda:0" if kind == "sglang" else ecfg.device)
        host = node_address()
        if kind == "sglang":
            self.proc = launch_sglang(model_path, ecfg.sglang_args_for(), host=host, api_key=api_key, log_path=log_path)
        else:
            extra = flags_of(ecfg) + ["--shm-prefix", shm_prefix]
            if weight_roots:
                extra += ["--weight-roots", *weight_roots]
            self.proc = launch_engine(model_path, host=host, threads=threads, extra_args=extra, api_key=api_key,
                                      log_path=log_path)

    def url(self) -> str:
        return self.proc.url

    def where(self) -> tuple[str, str]:
        """(host id, device) for the TransferMesh planner."""
        return ray.get_runtime_context().get_node_id(), self.device

    def placement_group(self) -> str | None:
        """The id of the placement group Ray placed this engine in."""
        from loongsage.cluster.placement import placement_group_of_this_actor

        return placement_group_of_this_actor()

    def log_tail(self) -> str:
        return self.proc.log_tail()

    def pid(self) -> int:
        return self.proc.proc.pid

    def stop(self) -> None:
        self.proc.stop()

    def kill(self) -> None:
        self.proc.kill()


class EngineGroup:
    def __init__(self, model_path: str, engine_cfg: EngineConfig, rollout: RolloutConfig,
                 shm_prefix: str = SHM_PREFIX, weight_roots: tuple[str, ...] = (), placement=None,
                 role: str = "engine", log_dir: str | None = None):
        """`placement`: the run's RunPlacement (engine i is its member `{role}-{i}`, and a restarted
        engine takes the same bundle), or None: each engine requests its own resources. `log_dir`:
        engine i's server writes `{log_dir}/{role}-{i}.log` (a restarted one appends to it), else a
        temporary file removed when it stops."""
        on_gpu = rollout.engine == "sglang" or engine_cfg.device.startswith("cuda")
        own = {"num_cpus": 0, "num_gpus": rollout.engine_gpus if on_gpu else 0,
               "resources": dict(rollout.engine_resources)}
        actor = ray.remote(EngineActor)
        self.api_key = secrets.token_urlsafe(32)  # clients: Router(urls, api_key=...), EngineClient(url, api_key)
        self._new = lambda i, cfg=engine_cfg: actor.options(**(placement.options(f"{role}-{i}") if placement else own)
                                                            ).remote(str(model_path), cfg, rollout.engine_threads,
                                                                     rollout.engine, self.api_key, shm_prefix,
                                                                     [str(r) for r in weight_roots],
                                                                     f"{log_dir}/{role}-{i}.log" if log_dir else None)
        self._restart_cfg = engine_cfg.model_copy(update={"inject_errors": None})  # a drill's fault ends with it
        self.actors = [self._new(i) for i in range(rollout.num_engines)]
        self.urls: list[str] = ray.get([a.url.remote() for a in self.actors])

    def restart(self, idx: int, timeout_s: float = 900.0) -> str:
        """Engine `idx` (dead, hung or failing) is stopped, its actor killed, and a new one started
        from the run's initial weights (the caller gives it the current ones); returns its URL."""
        stop_actors([self.actors[idx]], "kill", timeout_s=10.0)
        self.actors[idx] = self._new(idx, self._restart_cfg)
        self.urls[idx] = ray.get(self.actors[idx].url.remote(), timeout=timeout_s)
        return self.urls[idx]

    def shutdown(self) -> None:
        stop_actors(self.actors, "stop")
