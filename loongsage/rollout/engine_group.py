"""Inference engines as Ray actors: each launches one server (embedded engine, or SGLang on GPU)
on a free port of its node, waits for `/health`, and owns the process's lifetime."""
from __future__ import annotations

import ray

from loongsage.cluster.actors import stop_actors
from loongsage.engine.config import EngineConfig
from loongsage.rollout.config import RolloutConfig


class EngineActor:
    def __init__(self, model_path: str, cfg: dict, threads: int, kind: str):
        from loongsage.rollout.launcher import launch_engine, launch_sglang

        ecfg = EngineConfig.model_validate(cfg)
        from loongsage.transfer.devices import physical_device

        self.device = physical_device("cuda:0" if kind == "sglang" else ecfg.device)
        if kind == "sglang":
            self.proc = launch_sglang(model_path, ecfg.sglang_args_for())
        else:
            self.proc = launch_engine(model_path, threads=threads, extra_args=ecfg.cli_args())

    def url(self) -> str:
        return self.proc.url

    def where(self) -> tuple[str, str]:
        """(host id, device) for the TransferMesh planner."""
        return ray.get_runtime_context().get_node_id(), self.device

    def log_tail(self) -> str:
        return self.proc.log_tail()

    def stop(self) -> None:
        self.proc.stop()


class EngineGroup:
    def __init__(self, model_path: str, engine_cfg: EngineConfig, rollout: RolloutConfig):
        on_gpu = rollout.engine == "sglang" or engine_cfg.device.startswith("cuda")
        gpus = rollout.engine_gpus if on_gpu else 0
        actor = ray.remote(num_cpus=0, num_gpus=gpus)(EngineActor)
        self.actors = [actor.remote(str(model_path), engine_cfg.model_dump(), rollout.engine_threads, rollout.engine)
                       for _ in range(rollout.num_engines)]
        self.urls: list[str] = ray.get([a.url.remote() for a in self.actors])

    def shutdown(self) -> None:
        stop_actors(self.actors, "stop")
