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


def base_policy_dir(cfg) -> Path:
    key = json.dumps([cfg.model.model_dump(exclude={"cache_dir"}), cfg.task.model_dump(exclude={"data_dir"}),
                      cfg.bootstrap.sft.model_dump(), cfg.seed, cfg.agent.kind != "single_turn",
                      cfg.agent.limits.model_dump()], sort_keys=True)
    return Path(cfg.bootstrap.cache_dir) / f"{cfg.task.name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


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
    console.print(f"[bootstrap] SFT of {init} on {cfg.task.name} until dev accuracy >= "
                  f"{cfg.bootstrap.sft.target_accuracy}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    result = await sft_to(cfg, init, tmp, console)
    (tmp / "trainer_state.pt").unlink(missing_ok=True)  # a base policy starts with a fresh optimizer
    tmp.rename(out)
    console.print(f"[bootstrap] base policy at {out}: dev accuracy {result['dev_accuracy']:.3f} "
                  f"after {result['steps']} steps ({result['seconds']:.0f}s)")
    return out
