"""Where metric records go besides `metrics.jsonl` (always written): TensorBoard, Weights & Biases
and MLflow, chosen by `metrics.backends`. Each backend is one small class in its own file with
`log(record, step)` and `close()`; `open_backends` builds the configured ones for a run."""
from __future__ import annotations

from pathlib import Path

from loongsage.tracking.config import TrackingConfig


def open_backends(cfg: TrackingConfig, run_dir: str | Path, run_name: str, config: dict | None = None,
                  resumed_at: int | None = None) -> list:
    """`config`: the run's whole config, recorded with the run where the backend keeps one;
    `resumed_at`: the step a resumed run continues after (its backends continue the same run)."""
    run_dir = Path(run_dir)
    out = []
    for name in cfg.backends:
        if name == "tensorboard":
            from loongsage.tracking.tensorboard_log import TensorBoardLog
            out.append(TensorBoardLog(run_dir, resumed_at))
        elif name == "wandb":
            from loongsage.tracking.wandb_log import WandbLog
            out.append(WandbLog(cfg, run_dir, run_name, config, resumed_at))
        elif name == "mlflow":
            from loongsage.tracking.mlflow_log import MlflowLog
            out.append(MlflowLog(cfg, run_dir, run_name, config, resumed_at))
    return out


def kept_run_id(run_dir: Path, backend: str, new) -> str:
    """The backend's run id for this run directory: the one kept in RUN_DIR/tracking/<backend>_run_id
    (a resumed run continues that run), or `new()`'s, kept there now."""
    id_file = run_dir / "tracking" / f"{backend}_run_id"
    if id_file.is_file():
        return id_file.read_text().strip()
    run_id = new()
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id)
    return run_id


def numeric(record: dict) -> dict[str, float]:
    """The record's numbers (not the step itself, booleans or missing values)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
