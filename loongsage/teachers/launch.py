"""Bringing teachers up: a check that each speaks the student's tokenizer, their engines as Ray
actors, the manager, and weight routes to teachers that follow the student. (Their models, given or
bootstrapped, come from controller/bootstrap.py: teacher_models.)"""
from __future__ import annotations

import asyncio
from pathlib import Path

from transformers import AutoTokenizer

from loongsage.rollout.client import EngineClient
from loongsage.rollout.config import RolloutConfig
from loongsage.rollout.engine_group import EngineGroup
from loongsage.rollout.router import Router
from loongsage.teachers.manager import Teacher, TeacherManager


class TeacherError(ValueError):
    """A teacher that cannot serve this student (one line naming it)."""


def check_tokenizer(student_dir: str, teacher_dir: str, name: str) -> None:
    """Teachers score the student's exact token ids: their vocabularies must be the same."""
    student = AutoTokenizer.from_pretrained(student_dir).get_vocab()
    teacher = AutoTokenizer.from_pretrained(teacher_dir).get_vocab()
    if student != teacher:
        only_s = sorted(set(student) - set(teacher))[:3]
        moved = sorted(k for k in set(student) & set(teacher) if student[k] != teacher[k])[:3]
        raise TeacherError(f"teacher {name!r} ({teacher_dir}) has a different tokenizer than the student "
                           f"({len(teacher)} vs {len(student)} tokens; e.g. missing {only_s}, other ids for {moved}): "
                           "a teacher must score the student's exact token ids")


async def launch_teacher_engines(cfg, dirs: list[str], shm_prefix: str, placement=None,
                                 log_dir: str | None = None) -> list[EngineGroup]:
    """Engines for every teacher of `cfg.teachers` (Ray must be up; in their bundles of the run's
    `placement` when it has them), all started at once, logging to `{log_dir}/teacher-{name}-{i}.log`;
    none left running if one fails."""
    groups = await asyncio.gather(*[asyncio.to_thread(
        EngineGroup, d, t.engine, RolloutConfig(engine=t.kind, num_engines=t.num_engines, engine_threads=t.engine_threads,
                                                engine_resources=t.resources),
        shm_prefix, (), placement if placement is not None and placement.has(f"teacher-{t.name}-0") else None,
        f"teacher-{t.name}", log_dir) for t, d in zip(cfg.teachers, dirs)], return_exceptions=True)
    failed = [g for g in groups if isinstance(g, BaseException)]
    if failed:
        for g in groups:
            if not isinstance(g, BaseException):
                g.shutdown()
        raise failed[0]
    return list(groups)


async def start_teachers(cfg, dirs: list[str], student_dir: str, shm_prefix: str, trainers=None,
                         timeline=None, placement=None, groups: list[EngineGroup] | None = None) -> TeacherManager:
    """The manager of `cfg.teachers` over their engines (`groups`, as `launch_teacher_engines` started
    them beside the run's own; launched here when not given), and the weight route to teachers that
    follow the student (from `trainers`)."""
    if groups is None:
        groups = await launch_teacher_engines(cfg, dirs, shm_prefix, placement)
    teachers = []
    try:
        for t, d, g in zip(cfg.teachers, dirs, groups):
            health = cfg.rollout.health
            router = Router([], clients=[EngineClient(u, g.api_key) for u in g.urls],
                            engine_retries=health.engine_retries, engine_wait_s=health.engine_wait_s)
            teachers.append(Teacher(t, router, 0, g))
            info = await router.clients[0].model_info()
            teachers[-1].weight_bytes = int(info.get("weight_bytes")
                                            or sum(f.stat().st_size for f in Path(d).glob("*.safetensors")))
    except BaseException:
        for t in teachers:
            await t.router.aclose()
        for g in groups:
            g.shutdown()
        raise
    budget = None if cfg.teacher_memory_mb is None else cfg.teacher_memory_mb * 2**20
    opd = cfg.algo.loss.distill
    top_k = {"full": _vocab_size(student_dir), "topk": opd.top_k, None: 0}[opd.needs_top]
    manager = TeacherManager(teachers, budget, top_k, timeline)
    try:
        for t in teachers:
            if t.cfg.follow_student_every:
                manager.follow[t.name] = await _follow_mesh(cfg, trainers, t)
        return await manager.start()
    except BaseException:
        await stop_teachers(manager)
        raise


async def _follow_mesh(cfg, trainers, teacher: Teacher):
    """A TransferMesh from the trainer to the engines of a teacher that follows the student."""
    from loongsage.transfer.config import TransferConfig
    from loongsage.transfer.mesh import WeightMesh, discover
    from loongsage.transfer.topology import plan

    if trainers is None:
        raise TeacherError("teachers that follow the student need the trainer group")
    clients = [EngineClient(u, teacher.engines.api_key) for u in teacher.engines.urls]
    routes = plan(*discover(trainers, teacher.engines.actors, TransferConfig()))
    mesh = WeightMesh(routes, trainers, {f"engine-{i}": c for i, c in enumerate(clients)},
                      teacher.cfg.engine.dtype, cfg.rollout.weight_bucket_mb,
                      "nccl" if cfg.trainer.device.startswith("cuda") else "gloo",
                      extensions=teacher.cfg.kind == "embedded", pause_mode="none")
    await mesh.setup()
    return mesh


async def replace_teacher_engine(cfg, manager: TeacherManager, trainers, name: str, idx: int) -> None:
    """Engine `idx` of teacher `name` (dead, hung or failing) restarted as a new actor from the
    teacher's weights, released again if the teacher is not resident now; a teacher that follows
    the student gets its TransferMesh rebuilt and the trainer's current weights (its schedule goes
    on from the next due step). Then its router sends it requests again."""
    t = manager.teachers[name]
    t.router.mark_down(idx)
    url = await asyncio.to_thread(t.engines.restart, idx)
    client = EngineClient(url, t.engines.api_key)
    async with manager.residency:  # no swap while its residency is restored
        if name in manager.follow:
            await manager.follow[name].aclose(gone=[f"engine-{idx}"])
            manager.follow[name] = await _follow_mesh(cfg, trainers, t)
            async with trainers.stepping:
                await manager.follow[name].push(await trainers.version())
        if not t.resident:
            await client.release_memory()
    await t.router.replace(idx, client)


async def stop_teachers(manager: TeacherManager) -> None:
    await manager.close()
    for t in manager.teachers.values():
        if t.engines is not None:
            t.engines.shutdown()


def _vocab_size(model_dir: str) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_dir).vocab_size)
