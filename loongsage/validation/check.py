"""Checks a finished run directory against its expectations: pure over `metrics.jsonl` and
`summary.json`, so a run is judged the same way by `loongsage validate`, by CI and by hand
(`loongsage validate --run-dir`), and the verdict is written beside the run."""
from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from loongsage.metrics import read_metrics
from loongsage.validation.config import SUMMARY, Expectation


@dataclass
class Check:
    metric: str  # the expectation's label: stat(metric) [/ over]
    bound: str
    measured: float | None
    passed: bool
    why: str = ""
    problem: str = ""  # why nothing could be measured


def series(records: list[dict], key: str) -> list[float]:
    """The finite values of `key`, in step order (steps that logged null, e.g. a gap on a step that
    trained nothing, are left out)."""
    return [float(r[key]) for r in sorted(records, key=lambda r: r["step"])
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]


def measure(metric: str, stat: str, records: list[dict], summary: dict, window: int = 1) -> float:
    """One number of the run (`first`, `last` and `rise` over the mean of `window` values at each end);
    KeyError names what is missing."""
    if metric.startswith(SUMMARY):
        node = summary
        for part in metric[len(SUMMARY):].split("."):
            if not isinstance(node, dict) or part not in node:
                raise KeyError(f"{metric}: not in summary.json")
            node = node[part]
        if not isinstance(node, (int, float)):
            raise KeyError(f"{metric}: not a number in summary.json ({node!r})")
        return float(node)
    values = series(records, metric)
    if not values:
        raise KeyError(f"{metric}: no step logged it in metrics.jsonl")
    if len(values) < window and stat in ("first", "last", "rise"):
        raise KeyError(f"{metric}: {len(values)} values in metrics.jsonl, fewer than the window of {window}")
    first, last = sum(values[:window]) / window, sum(values[-window:]) / window
    return {"last": last, "first": first, "max": max(values), "min": min(values),
            "mean": sum(values) / len(values), "rise": last - first}[stat]


def check(expectations: list[Expectation], records: list[dict], summary: dict) -> list[Check]:
    out = []
    for e in expectations:
        try:
            value = measure(e.metric, e.stat, records, summary, e.window)
            if e.over is not None:
                denominator = measure(e.over, e.stat, records, summary, e.window)
                if denominator == 0:
                    raise KeyError(f"{e.over}: is 0, the ratio is undefined")
                value /= denominator
        except KeyError as exc:
            out.append(Check(e.label, e.bound, None, False, e.why, exc.args[0]))
            continue
        passed = (e.min is None or value >= e.min) and (e.max is None or value <= e.max)
        out.append(Check(e.label, e.bound, value, passed, e.why))
    return out


def check_run(run_dir: str | Path, expectations: list[Expectation]) -> list[Check]:
    """Against what the run left: a run that stopped early may lack summary.json, a demo has no
    metrics.jsonl; an expectation on what is missing fails, naming it."""
    path = Path(run_dir) / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    records = read_metrics(run_dir) if (Path(run_dir) / "metrics.jsonl").is_file() else []
    return check(expectations, records, summary)


def machine() -> str:
    """The machine class a wall-clock bound was met on."""
    gpus = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpus = f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"{os.cpu_count()} CPU cores ({platform.machine()}){gpus}"


def write_report(run_dir: str | Path, checks: list[Check], recipe: str, quick: bool) -> Path:
    """`RUN_DIR/validation.json` (the verdict and every check) and `validation.md` (the table)."""
    run_dir = Path(run_dir)
    passed = bool(checks) and all(c.passed for c in checks)
    (run_dir / "validation.json").write_text(json.dumps(
        {"recipe": recipe, "quick": quick, "passed": passed, "checked_at": time.strftime("%Y-%m-%d %H:%M"),
         "machine": machine(), "checks": [asdict(c) for c in checks]}, indent=1))
    lines = [f"# Validation of {recipe}{' (quick)' if quick else ''}: {'PASSED' if passed else 'FAILED'}", "",
             "| metric | bound | measured | result |", "|---|---|---|---|"]
    for c in checks:
        shown = f"{c.measured:.4g}" if c.measured is not None else c.problem
        lines.append(f"| {c.metric} | {c.bound} | {shown} | {'pass' if c.passed else 'FAIL'} |")
    out = run_dir / "validation.md"
    out.write_text("\n".join(lines) + "\n")
    return out
