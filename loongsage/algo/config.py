"""The `algo` section: advantage estimator and policy loss."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loongsage.extensions import plugin

KLEstimator = plugin("kl_estimator", ["k1", "k2", "k3"])
PolicyLoss = plugin("policy_loss", ["ppo"])
AdvantageEstimator = plugin("advantage", ["grpo", "dr_grpo", "rloo"])


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    clip_low: float = Field(0.2, ge=0.0)
    clip_high: float = Field(0.2, ge=0.0, description="> clip_low is DAPO's clip-higher")
    aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    is_mode: Literal["none", "metrics", "tis", "mis"] = "tis"
    is_level: Literal["token", "sequence"] = "token"
    is_cap: float = Field(2.0, gt=0.0, description="TIS truncation C; MIS upper bound")
    is_low: float = Field(0.5, ge=0.0, description="MIS lower bound")
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: KLEstimator = Field(
        "k3", description="k1 | k2 | k3 (Schulman), or module:attr of a (logprobs, ref_logprobs) -> per-token KL")
    policy_loss: PolicyLoss = Field(
        "ppo", description="ppo: the clipped decoupled objective with IS corrections (algo/losses.py), or module:attr "
                           "of a (PolicyInputs, LossConfig, denominator) -> (loss, metrics)")
    entropy_coef: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _bounds(self) -> LossConfig:
        if self.is_mode == "mis" and self.is_low >= self.is_cap:
            raise ValueError(f"is_low ({self.is_low}) must be below is_cap ({self.is_cap}) for masked IS")
        return self


class AlgoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    advantage: AdvantageEstimator = Field(
        "grpo", description="grpo | dr_grpo | rloo, or module:attr of a (rewards [groups, n]) -> advantages")
    loss: LossConfig = LossConfig()
    recompute_proximal: bool = Field(False, description=(
        "run a separate no-grad pass for the proximal logprobs before the update (verl/slime's old_log_prob). "
        "Off: one batch is one optimizer step, so the policy before the update is exactly the one in the "
        "update's own forward pass, whose detached logprobs serve; this saves a forward per step."))
