"""Base policies for the CPU recipes: a tiny model SFT'd to partial competence on its task,
cached under a key of everything that shapes it, so recipes and reruns reuse it."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from rich.console import Console

from loongsage.controller.sft import sft_to
from loongsage.models.prepare import resolve_model
from loongsage.teachers.config import TeacherConfig
from loongsage.teachers.launch import check_tokenizer


def base_policy_dir(cfg) -> Path:
    """Where the base policy of `cfg` is cached: a key of everything that shapes it (unset new
    fields are left out, so older caches stay valid). Of an agent's limits only the episode's turns
    and tokens shape it (its dev rollouts): a run with a shorter agent timeout or output cap reuses
    the same base policy."""
    parts = [[s.task.model_dump(exclude={"data_dir"} | ({"reward"} if s.task.reward is None else set())),
              s.agent.kind != "single_turn", s.agent.limits.model_dump(include={"max_turns", "max_tokens"})]
             for s in cfg.sources()]
    model = cfg.model.model_dump(exclude={"cache_dir"})
    if len(parts) == 1:
        task, is_agent, limits = parts[0]
        key = [model, task, cfg.bootstrap.sft.model_dump(exclude={"threads"}), cfg.seed, is_agent, limits]
    else:
        key = [model, parts, cfg.bootstrap.sft.model_dump(exclude={"threads"}), cfg.seed]
    name = "+".join(s.task.name.replace(":", "-") for s in cfg.sources())
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return Path(cfg.bootstrap.cache_dir).resolve() / f"{name}-{digest}"  # absolute: actors on other nodes


async def ensure_base_policy(cfg, console: Console | None = None) -> Path:
    """The run's starting policy: the cached bootstrap (built now if absent) or the configured model."""
    console = console or Console()
    init = resolve_model(cfg.model)
    if not cfg.bootstrap.enabled:
        return init
    out = base_policy_dir(cfg)
    if (out / "model.safetensors").is_file():
        console.print(f"[bootstrap] reusing base policy {out}")
        return out
    console.print(f"[bootstrap] SFT of {init} on {', '.join(s.task.name for s in cfg.sources())} until dev accuracy >= "
                  f"{cfg.bootstrap.sft.target_accuracy}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    result = await sft_to(cfg, init, tmp, console)
    (tmp / "trainer_state.pt").unlink(missing_ok=True)  # a base policy starts with a fresh optimizer
    tmp.rename(out)
    console.print(f"[bootstrap] base policy at {out}: dev accuracy {result['dev_accuracy']:.3f} "
                  f"after {result['steps']} steps ({result['seconds']:.0f}s)")
    return out


def teacher_bootstrap_config(cfg, teacher: TeacherConfig):
    """The single-source run config whose base policy is `teacher`'s bootstrap: the run's model on the
    teacher's task and agent, with the teacher's sampling or that of the first source it serves."""
    from loongsage.config import BootstrapConfig

    b = teacher.bootstrap
    sampling = b.sampling or next((s.sampling for s in cfg.sources() if teacher.name in s.teachers), cfg.sampling)
    boot = BootstrapConfig(enabled=True, cache_dir=cfg.bootstrap.cache_dir, sft=b.sft)
    return cfg.model_copy(update={"task": b.task, "agent": b.agent, "sampling": sampling, "data_sources": [],
                                  "teachers": [], "bootstrap": boot})


async def ensure_teacher_model(cfg, teacher: TeacherConfig, student_dir: str, console: Console) -> str:
    """The teacher's model folder: `model`, the student itself (a teacher that only follows the
    student), or a cached bootstrap SFT of the run's model on the teacher's task."""
    if teacher.model is not None:
        return teacher.model
    if teacher.bootstrap is None:
        return student_dir
    console.print(f"[teacher {teacher.name}] model: SFT on {teacher.bootstrap.task.name}")
    return str(await ensure_base_policy(teacher_bootstrap_config(cfg, teacher), console))


async def teacher_models(cfg, student_dir: str, console: Console | None = None) -> list[str]:
    """Every teacher's model folder (bootstraps run now, before the run's own actors start), each
    checked against the student's tokenizer."""
    console = console or Console()
    dirs = [await ensure_teacher_model(cfg, t, student_dir, console) for t in cfg.teachers]
    for t, d in zip(cfg.teachers, dirs):
        check_tokenizer(student_dir, d, t.name)
    return dirs
