"""Tracking backends (`metrics.backends`), offline: every record of metrics.jsonl reaches W&B (offline
files) and MLflow (a local store) under the same names and steps, and a resumed run continues the
same W&B and MLflow runs."""
from __future__ import annotations

import json

import pytest

from loongsage.config import ConfigError, load_config
from loongsage.metrics import MetricsWriter
from loongsage.tracking.config import TrackingConfig

RECORDS = [{"step": 0, "version": 0, "eval/accuracy": 0.25}, {"step": 1, "version": 1, "reward/mean": 0.5,
                                                               "time/step_s": 0.2, "mismatch/kl": None}]


def _mlflow_history(run_dir, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())  # the writer allowed the file store
    run_id = (run_dir / "tracking" / "mlflow_run_id").read_text()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_mlflow_and_wandb_offline_receive_every_record_and_a_resume_continues_their_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = TrackingConfig(backends=["jsonl", "wandb", "mlflow"], project="t")
    w = MetricsWriter(tmp_path, cfg, config={"name": "t", "seed": 3})
    for r in RECORDS:
        w.write(r)
    w.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert _mlflow_history(tmp_path, "reward/mean") == [(1, 0.5)]
    assert _mlflow_history(tmp_path, "eval/accuracy") == [(0, 0.25)]
    assert _mlflow_history(tmp_path, "mismatch/kl") == []  # a missing value is not logged as a number
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    wandb_id = (tmp_path / "tracking" / "wandb_run_id").read_text()
    assert len(runs) == 1 and runs[0].name.endswith(wandb_id) and any(runs[0].glob("*.wandb"))

    resumed = MetricsWriter(tmp_path, cfg, resumed_at=1)  # step 1 was logged: the resume goes on at 2
    resumed.write({"step": 1, "version": 1, "reward/mean": 0.9})
    resumed.write({"step": 2, "version": 2, "reward/mean": 0.75})
    resumed.close()
    assert _mlflow_history(tmp_path, "reward/mean") == [(1, 0.5), (2, 0.75)]  # the same MLflow run
    assert (tmp_path / "tracking" / "wandb_run_id").read_text() == wandb_id
    assert all(r.name.endswith(wandb_id) for r in (tmp_path / "wandb").glob("offline-run-*"))


def test_backends_are_checked_when_the_config_loads(monkeypatch):
    cfg = load_config("recipes/arith_grpo.yaml", ["metrics.backends=[jsonl,mlflow]"])
    assert cfg.metrics.backends == ["jsonl", "mlflow"] and cfg.metrics.project == "loongsage"
    with pytest.raises(ConfigError, match="metrics.backends"):
        load_config("recipes/arith_grpo.yaml", ["metrics.backends=[neptune]"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb is not installed.*\.\[tracking\]"):
        load_config("recipes/arith_grpo.yaml", ["metrics.backends=[wandb]"])
