"""Metric records: one JSON object per training step in `metrics.jsonl`, mirrored to the tracking
backends of `metrics.backends` (TensorBoard by default; W&B, MLflow: `loongsage/tracking/`).

Stable names (DESIGN.md's run-directory contract): step, version, reward/mean, reward/<tag>/mean,
samples/trained, samples/dropped_stale, samples/cancelled, samples/filtered_groups, samples/aborted_by_system,
samples/resumed_after_abort, samples/retried, engine/restarts, staleness/mean, staleness/max,
mismatch/kl, mismatch/abs_logprob_diff, time/step_s, time/generate_s, time/train_s,
time/generate_busy_frac, time/train_busy_frac, time/weight_sync_s, loss/*, is/*, train/*, offpolicy/*,
and eval/accuracy, eval/<tag>/accuracy on the steps an evaluation ran after (step 0: before training).
`mismatch/*` is the train-inference gap on tokens sampled by the version being trained (null when
a step trains none: nothing trained, or only older tokens); `offpolicy/*` the drift of older tokens
(algo/mismatch.py). A step that trains nothing (`train/skipped_no_signal` 1) keeps every name.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from loongsage.tracking import open_backends
from loongsage.tracking.config import TrackingConfig

REQUIRED = ["step", "version", "reward/mean", "samples/trained", "samples/dropped_stale", "staleness/mean",
            "staleness/max", "mismatch/kl", "mismatch/abs_logprob_diff", "time/step_s",
            "time/generate_busy_frac", "time/train_busy_frac", "time/weight_sync_s"]


class MetricsWriter:
    def __init__(self, run_dir: str | Path, tracking: TrackingConfig | None = None, resumed_at: int | None = None,
                 run_name: str | None = None, config: dict | None = None):
        """`tracking`: the backends that mirror metrics.jsonl (default: TensorBoard); `resumed_at`:
        the step a resumed run continues after; `config`: the run's config, kept with the run by
        the backends that keep one."""
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        self._backends = open_backends(tracking or TrackingConfig(), run_dir, run_name or Path(run_dir).name, config,
                                       resumed_at)

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        for backend in self._backends:
            backend.log(clean, record["step"])

    def close(self) -> None:
        self._file.close()
        for backend in self._backends:
            backend.close()


def truncate_metrics(run_dir: str | Path, step: int) -> None:
    """Keeps the records of steps up to `step` (a resume from that step's checkpoint redoes the rest)."""
    path = Path(run_dir) / "metrics.jsonl"
    kept = [line for line in path.read_text().splitlines(True) if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics (is {run_dir} a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
