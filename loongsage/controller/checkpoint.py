"""Run checkpoints that a resume can trust, and what the controller needs to continue from one.

    RUN_DIR/checkpoints/step_<N>/ (and final/)   the trainer's HF folder (weights, config, tokenizer),
                                                 trainer_state.pt (optimizer, LR schedule, version),
                                                 controller.json (below)
    RUN_DIR/checkpoints/latest                   the name of the last complete checkpoint

A checkpoint is written under `<name>.partial` and renamed when complete, and only then does
`latest` (replaced atomically) name it: a run killed mid-write leaves the previous checkpoint in
force and a `.partial` folder nobody reads.

`controller.json` holds the step and, per data source, the sampler cursor to draw from on resume:
the prompt of the oldest group without a fate at the checkpoint (groups generating, buffered, or
taken for the next batch are drawn again, with the same per-prompt sampling seeds when seeded, so a
synchronous run resumes into the same samples) and the later cursors that had one (not drawn
again); the prompt ledger's length (`controller/ledger.py`); and the teachers the run had (a resume
with other teachers is refused).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loongsage.config import ConfigError

TRACKER = "latest"


@dataclass
class ControllerState:
    step: int
    cursors: dict[str, int]  # data source -> sampler cursor to resume from
    teachers: list[str]
    seed: int
    ledger_lines: int = 0  # prompts.jsonl lines at the checkpoint
    settled: dict[str, list[int]] = field(default_factory=dict)  # source -> cursors past its resume cursor with a fate


async def save_checkpoint(run_dir: Path, name: str, state: ControllerState, trainers) -> Path:
    """Writes checkpoint `name` (trainer state + controller state) atomically and points the tracker at it."""
    root = Path(run_dir) / "checkpoints"
    final, partial = root / name, root / f"{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    await trainers.save(str(partial))
    _write_atomic(partial / "controller.json", json.dumps(asdict(state), indent=1))
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    _write_atomic(root / TRACKER, name + "\n")
    return final


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The last complete checkpoint of a run, or a clear error naming what is missing."""
    root = Path(run_dir) / "checkpoints"
    tracker = root / TRACKER
    if not tracker.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no complete checkpoint ({tracker} is missing; "
                                "set train.save_every to write checkpoints during a run)")
    ckpt = root / tracker.read_text().strip()
    if not (ckpt / "controller.json").is_file():
        raise FileNotFoundError(f"--resume {run_dir}: {tracker} names {ckpt.name}, which is incomplete")
    return ckpt


def read_state(ckpt: Path, cfg) -> ControllerState:
    """The controller state of `ckpt`, checked against the run config it resumes with."""
    state = ControllerState(**json.loads((ckpt / "controller.json").read_text()))
    teachers = [t.name for t in cfg.teachers]
    if teachers != state.teachers:
        raise ConfigError(f"--resume: the checkpoint was trained with teachers {state.teachers}, the config has "
                         f"{teachers}; resume with the run's own teachers")
    sources = [s.name for s in cfg.sources()]
    if sorted(sources) != sorted(state.cursors):
        raise ConfigError(f"--resume: the checkpoint has data sources {sorted(state.cursors)}, the config {sources}")
    if cfg.train.steps <= state.step:
        raise ConfigError(f"--resume: the checkpoint is at step {state.step}; set train.steps above it to go on")
    return state


def controller_state(step: int, cfg, sources, ledger) -> ControllerState:
    """The state to save at `step` (the ledger synced to disk first: its lines are the checkpoint's)."""
    ledger.sync()
    cursors = {src.name: src.producer.resume_cursor() for src in sources}
    return ControllerState(step, cursors, [t.name for t in cfg.teachers], cfg.seed, ledger.lines,
                           {name: ledger.settled_from(name, c) for name, c in cursors.items()})


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def stopped_message(run_dir: Path, exc: BaseException) -> str:
    """What a run that stopped (its trainer died, an engine could not be kept up, Ctrl-C) tells
    its user: why, and the command that resumes it from its last complete checkpoint."""
    why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
    try:
        ckpt = latest_checkpoint(run_dir)
    except (FileNotFoundError, OSError):
        return (f"the run in {run_dir} stopped ({why}) before its first checkpoint; start it again "
                "(train.save_every sets how often checkpoints are written)")
    return (f"the run in {run_dir} stopped ({why}).\nResume it from its last checkpoint ({ckpt.name}) with:\n"
            f"  loongsage train --resume {run_dir}")
