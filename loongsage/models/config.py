"""Which policy model a run starts from: an HF folder, or a tiny model built from a spec."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class TinyModelSpec(BaseModel):
    """Shape of a tiny model; the defaults are PROBES.md's 0.53M-parameter Qwen3 that learns addition."""

    model_config = ConfigDict(extra="forbid")
    arch: Literal["qwen3", "qwen2", "llama"] = "qwen3"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(512, ge=8)
    vocab_size: int = Field(128, ge=16)
    max_position_embeddings: int = Field(512, ge=16)
    tie_word_embeddings: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _heads(self) -> TinyModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        return self


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None  # an HF causal-LM folder; None builds `tiny` into `cache_dir`
    tiny: TinyModelSpec = TinyModelSpec()
    cache_dir: str = ".cache/loongsage/models"
