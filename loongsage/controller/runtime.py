"""The actors one run drives: trainer group, engine group, router and weight sync, started and
stopped together (so SFT, bootstrap and RL share one way of bringing a run up and down)."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import ray

from loongsage.cluster.config import RayConfig
from loongsage.cluster.placement import PlacementConfig, RunPlacement, layout
from loongsage.cluster.ray_setup import init_ray
from loongsage.engine.config import EngineConfig
from loongsage.heap import freeze_long_lived
from loongsage.rollout.config import RolloutConfig
from loongsage.rollout.engine_group import EngineGroup
from loongsage.rollout.router import Router
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.group import TrainerGroup
from loongsage.transfer.config import TransferConfig
from loongsage.transfer.mesh import WeightMesh, discover
from loongsage.transfer.shm_names import SHM_PREFIX
from loongsage.transfer.topology import plan

SHM_RECORD = "shm_prefix"  # RUN_DIR file naming the run's /dev/shm prefix while it runs


def record_transfer_plan(run_dir: Path, mesh: WeightMesh) -> None:
    """RUN_DIR/transfer_plan.json: the weight-sync routes planned from where Ray placed the actors."""
    p = mesh.plan
    (run_dir / "transfer_plan.json").write_text(json.dumps({
        "sender": {"name": p.sender.name, "host": p.sender.host, "device": p.sender.device},
        "routes": [dataclasses.asdict(r) for r in p.routes], "text": p.format()}, indent=1))


def record_shm_prefix(run_dir: Path, prefix: str) -> None:
    """Notes where the run's shared buffers live, so a resume after a crash can remove them."""
    (Path(run_dir) / SHM_RECORD).write_text(prefix)


def remove_crashed_shm(run_dir: Path) -> int:
    """Removes the /dev/shm buffers of an earlier attempt of this run that died without cleaning up
    (a killed controller's trainer ranks never free theirs); returns how many."""
    record = Path(run_dir) / SHM_RECORD
    prefix = record.read_text().strip() if record.is_file() else ""
    if not re.fullmatch(re.escape(SHM_PREFIX) + r"[0-9a-f]{8}-", prefix):  # only a name this code made
        return 0
    removed = 0
    for f in Path("/dev/shm").glob(prefix + "*"):
        f.unlink(missing_ok=True)
        removed += 1
    record.unlink()
    return removed


def client_factory(client_class: str | None, api_key: str | None):
    """url -> a client of the run's engines: the SGLang-protocol HTTP client, or `rollout.client`."""
    from loongsage.extensions import resolve
    from loongsage.rollout.client import EngineClient

    cls = EngineClient if client_class is None else resolve(client_class, "client")
    return lambda url: cls(url, api_key)


async def build_mesh(trainers: TrainerGroup, engines: EngineGroup, trainer: TrainerConfig, engine: EngineConfig,
                     rollout: RolloutConfig, transfer: TransferConfig, disk_dir: str | None,
                     colocated: bool = False) -> WeightMesh:
    """The TransferMesh from the trainer to the engines where Ray placed them (routes planned from
    their nodes and devices), set up and ready to deliver."""
    client = client_factory(rollout.client, engines.api_key)
    routes = plan(*discover(trainers, engines.actors, transfer))
    sync = WeightMesh(routes, trainers, {f"engine-{i}": client(u) for i, u in enumerate(engines.urls)},
                      engine.dtype, rollout.weight_bucket_mb, "nccl" if trainer.device.startswith("cuda") else "gloo",
                      transfer.verify_every if rollout.engine == "embedded" else 0,  # SGLang: no checksum route
                      disk_dir, extensions=rollout.engine == "embedded", pause_mode=rollout.pause_mode,
                      implementations=transfer.implementations, colocated=colocated)
    await sync.setup()
    return sync


@dataclass
class Runtime:
    trainers: TrainerGroup
    engines: EngineGroup
    router: Router
    sync: WeightMesh
    ray_started: bool
    reference: TrainerGroup | None = None  # frozen initial policy, for a KL penalty
    temp_weights_dir: str | None = None  # the disk route's folder when the config names none
    shm_prefix: str = SHM_PREFIX  # the run's /dev/shm names (its other engines, e.g. teachers, use it too)
    remesh: Callable[[], Awaitable[WeightMesh]] | None = None  # a new TransferMesh over the current engines
    client: Callable[[str], object] | None = None  # url -> a client of the run's engines
    placement: RunPlacement | None = None  # the run's placement group (its teachers' bundles too)
    teacher_engines: list | None = None  # started beside the rest (`launch_teachers`) until a manager takes them
    startup: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)  # (phase, start, end), perf_counter

    @classmethod
    async def start(cls, model_dir: str, trainer: TrainerConfig, engine: EngineConfig, rollout: RolloutConfig,
                    ray_cfg: RayConfig, with_reference: bool = False,
                    transfer: TransferConfig | None = None, reference_dir: str | None = None,
                    placement: PlacementConfig | None = None, teachers=(),
                    launch_teachers: Callable[[str, RunPlacement], Awaitable[list]] | None = None,
                    log_dir: str | None = None) -> Runtime:
        """`model_dir`: the policy the trainer and engines start from; `reference_dir`: the KL
        reference's weights (default: the same); `placement`: how the actors (and the engines of
        `teachers`) are laid out in the run's placement group; `launch_teachers(shm_prefix, pg)`
        starts the teachers' engines beside the trainers and engines (`Runtime.teacher_engines`);
        `log_dir`: where the engines' servers write their logs (`engine-{i}.log`)."""
        phases, t = [], time.perf_counter()

        def phase(name: str) -> None:
            nonlocal t
            phases.append((name, t, time.perf_counter()))
            t = phases[-1][2]

        started = init_ray(ray_cfg)
        phase("Ray")
        trainers = engines = reference = pg = None
        teacher_engines: list = []
        transfer = transfer or TransferConfig()
        # The run's own names: its shared-memory buffers (engines map no others) and, when the config
        # names no folder, the disk route's (the only place engines load weight files from).
        shm_prefix = f"{SHM_PREFIX}{secrets.token_hex(4)}-"
        temp_dir = None if transfer.disk_dir else tempfile.mkdtemp(prefix="loongsage-weights-")
        disk_dir = transfer.disk_dir or temp_dir
        placement = placement or PlacementConfig()
        if placement.mode == "colocated" and rollout.engine == "sglang" and "--enable-memory-saver" not in engine.sglang_args:
            # SGLang releases its weights and KV cache (torch_memory_saver) only when started with it
            engine = engine.model_copy(update={"sglang_args": [*engine.sglang_args, "--enable-memory-saver"]})
        try:
            pg = await asyncio.to_thread(RunPlacement, layout(placement.mode, trainer, rollout, teachers, with_reference),
                                         placement, f"loongsage-{shm_prefix.removeprefix(SHM_PREFIX).strip('-')}")
            phase("placement group")
            # Trainer ranks, engines (and the reference) start in parallel: each spends seconds
            # importing torch and loading weights in its own process.
            parts = await asyncio.gather(
                asyncio.to_thread(TrainerGroup, trainer, model_dir, shm_prefix, pg),
                asyncio.to_thread(EngineGroup, model_dir, engine, rollout, shm_prefix, (disk_dir,), pg, log_dir=log_dir),
                *([asyncio.to_thread(TrainerGroup, trainer, reference_dir or model_dir, shm_prefix, pg, "reference")]
                  if with_reference else []),
                *([launch_teachers(shm_prefix, pg)] if launch_teachers else []),
                return_exceptions=True)
            trainers, engines = (p if not isinstance(p, BaseException) else None for p in parts[:2])
            reference = parts[2] if with_reference and not isinstance(parts[2], BaseException) else None
            if launch_teachers and not isinstance(parts[-1], BaseException):
                teacher_engines = parts[-1]
            failed = [p for p in parts if isinstance(p, BaseException)]
            if failed:
                raise failed[0]
            phase("trainer ranks, engines" + (", teachers' engines" if launch_teachers else ""))
            remesh = functools.partial(build_mesh, trainers, engines, trainer, engine, rollout, transfer, disk_dir,
                                       placement.mode == "colocated")
            sync = await remesh()
            phase("TransferMesh")
            freeze_long_lived()  # the controller's imports and clients: out of the cyclic GC's full passes (heap.py)
        except BaseException:
            for group in (engines, trainers, reference, *teacher_engines):
                if group is not None:
                    group.shutdown()
            if pg is not None:
                pg.remove()
            if started:
                ray.shutdown()
            if temp_dir:
                shutil.rmtree(temp_dir, ignore_errors=True)
            raise
        client = client_factory(rollout.client, engines.api_key)
        router = Router([], clients=[client(u) for u in engines.urls], abort_retries=rollout.abort_retries,
                        engine_retries=rollout.health.engine_retries, engine_wait_s=rollout.health.engine_wait_s,
                        coalesce_prompts=rollout.coalesce_prompts)
        return cls(trainers, engines, router, sync, started, reference, temp_dir, shm_prefix, remesh, client, pg,
                   teacher_engines if launch_teachers else None, phases)

    def __post_init__(self) -> None:
        self.sync_lock = asyncio.Lock()  # held from a weight update's begin to its end, and by a mesh rebuild

    async def replace_engine(self, idx: int) -> None:
        """Engine `idx` (dead, hung or failing) is restarted as a new actor and given the trainer's
        current weights over a rebuilt TransferMesh (routes planned from where Ray placed it; the
        others keep theirs and get the same version); then the router sends it requests again."""
        self.router.mark_down(idx)
        url = await asyncio.to_thread(self.engines.restart, idx)
        async with self.sync_lock:  # between two weight updates
            await self.sync.aclose(gone=[f"engine-{idx}"])
            self.sync = await self.remesh()
            await self.push_current_weights()
        await self.router.replace(idx, self.client(url))

    async def push_current_weights(self) -> None:
        """Every engine gets the trainer's weights under the trainer's version, taken between whole
        steps (the caller holds `sync_lock`)."""
        async with self.trainers.stepping:
            await self.sync.push(await self.trainers.version())

    async def close(self) -> None:
        """Every step runs even when an earlier one fails (a dead trainer fails the TransferMesh's
        close, yet the engines must still stop and the run's temporary folder go); the first
        failure is raised at the end."""
        steps: list[Callable[[], object]] = [self.router.aclose, self.sync.aclose,
                                             *(g.shutdown for g in self.teacher_engines or ()),  # not taken by a manager
                                             self.engines.shutdown, self.trainers.shutdown]
        if self.reference is not None:
            steps.append(self.reference.shutdown)
        if self.placement is not None:
            steps.append(self.placement.remove)
        if self.ray_started:
            steps.append(ray.shutdown)
        if self.temp_weights_dir:
            steps.append(functools.partial(shutil.rmtree, self.temp_weights_dir, ignore_errors=True))
        first: BaseException | None = None
        for step in steps:
            try:
                out = step()
                if asyncio.iscoroutine(out):
                    await out
            except Exception as exc:  # the rest still runs; the first is raised below
                first = first or exc
        if first is not None:
            raise first
