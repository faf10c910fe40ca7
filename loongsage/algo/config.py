"""The `algo` section: advantage estimator and policy loss."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loongsage.algo.losses import LossConfig


class AlgoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    loss: LossConfig = LossConfig()
    recompute_proximal: bool = Field(False, description=(
        "run a separate no-grad pass for the proximal logprobs before the update (verl/slime's old_log_prob). "
        "Off: one batch is one optimizer step, so the policy before the update is exactly the one in the "
        "update's own forward pass, whose detached logprobs serve; this saves a forward per step."))
