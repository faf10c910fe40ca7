"""`loongsage validate RECIPE [--quick] [--run-dir DIR]`: run a recipe (or take a finished run),
check every expectation, print the table, write it with the plots into the run directory, and
return the exit status (0: every expectation met; 1: any missed, or the run stopped; 3: a GPU
recipe on a machine without a GPU, not run)."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from loongsage.config import ConfigError, RunConfig, load_config
from loongsage.controller.checkpoint import stopped_message
from loongsage.tasks.dataset import DataError
from loongsage.validation.check import Check, check_run, write_report
from loongsage.validation.config import Expectation

NOT_RUN = 3


def validated_config(recipe: str, overrides: list[str], quick: bool) -> tuple[RunConfig, list[Expectation]]:
    """The config to run (the quick overrides first, so the user's win) and the bounds it must meet."""
    cfg = load_config(recipe, overrides)
    if quick:
        cfg = load_config(recipe, [*cfg.quick.overrides, *overrides])
    expectations = cfg.quick.expect if quick and cfg.quick.expect is not None else cfg.expect
    if not expectations:
        raise ConfigError(f"{recipe}: {'quick.expect / ' if quick else ''}expect: no expectations to validate "
                          "(add an expect: list of bounds, see docs/recipes.md)")
    return cfg, expectations


def needs_gpu(cfg: RunConfig) -> list[str]:
    """The settings of `cfg` that need an NVIDIA GPU (empty: it runs on CPU)."""
    wants = [f"trainer.device={cfg.trainer.device}"] if cfg.trainer.device.startswith("cuda") else []
    wants += [f"engine.device={cfg.engine.device}"] if cfg.engine.device.startswith("cuda") else []
    return wants + (["rollout.engine=sglang"] if cfg.rollout.engine == "sglang" else [])


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def show(checks: list[Check], title: str, console: Console) -> None:
    table = Table(title=title)
    for col in ("metric", "bound", "measured", "result", "why"):
        table.add_column(col)
    for c in checks:
        measured = f"{c.measured:.4g}" if c.measured is not None else f"[red]{c.problem}[/red]"
        table.add_row(c.metric, c.bound, measured, "[green]pass[/green]" if c.passed else "[red]FAIL[/red]", c.why)
    console.print(table)


def validate(recipe: str, overrides: list[str], quick: bool, run_dir: str | None = None) -> int:
    """A recipe with a `demo:` section is the engine demo (`loongsage demo`); any other is a training run."""
    from loongsage.controller.train import train
    from loongsage.demo import run_demo
    from loongsage.plot import plot_run
    from loongsage.timeline import render_timeline

    console = Console(width=None if sys.stdout.isatty() else 160)
    cfg, expectations = validated_config(recipe, overrides, quick)
    stopped = None
    gpu = needs_gpu(cfg)
    if run_dir is None and gpu and not gpu_available():
        print(f"validate: {recipe} needs an NVIDIA GPU ({', '.join(gpu)}) and this machine has none: not run, "
              "nothing checked (exit 3). Run it on a GPU node (scripts/gpu_check.sh checks the GPU paths first).",
              file=sys.stderr)
        return NOT_RUN
    if run_dir is None:  # run it
        run_dir = str(cfg.resolve_run_dir())
        try:
            run_demo(cfg) if "demo" in cfg.model_fields_set else asyncio.run(train(cfg))
        except (ConfigError, DataError, FileNotFoundError):  # refused before it ran
            raise
        except (Exception, KeyboardInterrupt) as exc:  # judged on what it left, and failed
            stopped = stopped_message(Path(run_dir), exc)
            print(stopped, file=sys.stderr)
            if isinstance(exc, KeyboardInterrupt):
                raise
    if not Path(run_dir).is_dir():
        print(f"validate: {run_dir} does not exist (the run did not start)", file=sys.stderr)
        return 1
    checks = check_run(run_dir, expectations)
    report = write_report(run_dir, checks, recipe, quick)
    if (Path(run_dir) / "metrics.jsonl").is_file():
        plot_run(run_dir)
    if (Path(run_dir) / "timeline.json").is_file():
        render_timeline(run_dir)
    passed = stopped is None and all(c.passed for c in checks)
    show(checks, f"{recipe}{' (quick)' if quick else ''}: {'PASSED' if passed else 'FAILED'}", console)
    console.print(f"report: {report}" + ("" if stopped is None else " (the run stopped before its end)"))
    return 0 if passed else 1
