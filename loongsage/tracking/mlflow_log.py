"""MLflow: a local file store in RUN_DIR/mlruns by default, or `metrics.mlflow_tracking_uri` (a
database such as sqlite:///PATH needs the full `mlflow` package, or a tracking server). The MLflow
run id is kept in RUN_DIR/tracking/mlflow_run_id, so a resumed run continues the same run."""
from __future__ import annotations

import os
import time
from pathlib import Path

from loongsage.tracking import numeric
from loongsage.tracking.config import TrackingConfig


class MlflowLog:
    def __init__(self, cfg: TrackingConfig, run_dir: Path, run_name: str, config: dict | None, resumed_at: int | None):
        from mlflow.tracking import MlflowClient

        uri = cfg.mlflow_tracking_uri
        if uri is None:  # a file store needs nothing installed; MLflow 3 wants it allowed explicitly
            uri = (run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        id_file = run_dir / "tracking" / "mlflow_run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        if id_file.is_file():
            self.run_id = id_file.read_text().strip()
        else:
            exp = self.client.get_experiment_by_name(cfg.project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.project)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id)
            if config:
                self.client.log_dict(self.run_id, config, "config.json")
        self._after = resumed_at

    def log(self, record: dict, step: int) -> None:
        if self._after is not None and step <= self._after:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        # MLflow keys allow letters, digits and _-./ and spaces: LoongSage's names (reward/mean) fit
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in numeric(record).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
