"""Weights & Biases: offline by default (RUN_DIR/wandb, no network needed; `wandb sync` uploads).
The W&B run id is kept in RUN_DIR/tracking/wandb_run_id, so a resumed run continues the same run."""
from __future__ import annotations

import secrets
from pathlib import Path

from loongsage.tracking import kept_run_id, numeric
from loongsage.tracking.config import TrackingConfig


class WandbLog:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, config: dict | None, resumed_at: int | None):
        import wandb

        run_id = kept_run_id(run_dir, "wandb", lambda: secrets.token_hex(4))
        self._run = wandb.init(project=cfg.project, name=run_name, id=run_id, dir=str(run_dir), mode=cfg.wandb_mode,
                               config=config, resume="allow", reinit="create_new",
                               settings=wandb.Settings(silent=True, x_disable_stats=True, console="off"))
        self._after = resumed_at  # W&B keeps every step once: a resume does not log the redone steps again

    def log(self, record: dict, step: int) -> None:
        if self._after is not None and step <= self._after:
            return
        self._run.log(numeric(record), step=step)

    def close(self) -> None:
        self._run.finish()
