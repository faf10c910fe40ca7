"""The `metrics` section of a run config: which tracking backends mirror `metrics.jsonl`."""
from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# backend -> the package it needs (None: part of the base install)
PACKAGES = {"jsonl": None, "tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class TrackingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    backends: list[Literal["jsonl", "tensorboard", "wandb", "mlflow"]] = Field(
        default_factory=lambda: ["jsonl", "tensorboard"],
        description="where metrics go; metrics.jsonl is always written (listing jsonl is optional)")
    project: str = Field("loongsage", min_length=1, description="W&B project / MLflow experiment")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: W&B writes RUN_DIR/wandb/ only (`wandb sync` uploads it later)")
    mlflow_tracking_uri: str | None = Field(
        None, description="default: a local store in RUN_DIR/mlruns (`mlflow ui --backend-store-uri RUN_DIR/mlruns`)")

    @field_validator("backends")
    @classmethod
    def _installed(cls, backends: list[str]) -> list[str]:
        if len(set(backends)) != len(backends):
            raise ValueError(f"a backend is listed twice: {backends}")
        for name in backends:
            package = PACKAGES[name]
            if package and importlib.util.find_spec(package) is None:
                raise ValueError(f"{name} is not installed (the `{package}` package); install the tracking extra: "
                                 "pip install -c constraints/cpu.txt -e .[tracking]")
        return backends
