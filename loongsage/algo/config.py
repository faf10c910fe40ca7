"""The `algo` section: advantage estimator and policy loss."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from loongsage.algo.losses import LossConfig


class AlgoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    loss: LossConfig = LossConfig()
