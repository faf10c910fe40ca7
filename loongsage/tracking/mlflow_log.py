"""MLflow: a local file store in RUN_DIR/mlruns by default, or `metrics.mlflow_tracking_uri` (a
database such as sqlite:///PATH needs the full `mlflow` package, or a tracking server). The MLflow
run id is kept in RUN_DIR/tracking/mlflow_run_id, so a resumed run continues the same run."""
from __future__ import annotations

import os
import time
from pathlib import Path

from loongsage.tracking import kept_run_id, numeric
from loongsage.tracking.config import TrackingConfig


class MlflowLog:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, config: dict | None, resumed_at: int | None):
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        uri = cfg.mlflow_tracking_uri
        if uri is None:  # a file store needs nothing installed; MLflow 3 wants it allowed explicitly
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)

        def new_run() -> str:
            exp = self.client.get_experiment_by_name(cfg.project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.project)
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            if config:
                self.client.log_dict(run_id, config, "config.json")
            return run_id

        self.run_id = kept_run_id(run_dir, "mlflow", new_run)
        self._metric = Metric
        self._after = resumed_at

    def log(self, record: dict, step: int) -> None:
        if self._after is not None and step <= self._after:
            return
        now = int(time.time() * 1000)
        # MLflow keys allow letters, digits and _-./ and spaces: LoongSage's names (reward/mean) fit
        self.client.log_batch(self.run_id, metrics=[self._metric(k, v, now, step) for k, v in numeric(record).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
