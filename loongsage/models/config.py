"""Which policy model a run starts from: an HF folder, or a tiny model built from a spec."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from loongsage.models.factory import TinyModelSpec


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None  # an HF causal-LM folder; None builds `tiny` into `cache_dir`
    tiny: TinyModelSpec = TinyModelSpec()
    cache_dir: str = ".cache/loongsage/models"
