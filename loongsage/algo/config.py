"""The `algo` section: advantage estimator and policy loss."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loongsage.extensions import plugin

KLEstimator = plugin("kl_estimator", ["k1", "k2", "k3"])
PolicyLoss = plugin("policy_loss", ["ppo"])
AdvantageEstimator = plugin("advantage", ["grpo", "dr_grpo", "rloo", "group_zscore", "group_mean", "batch_zscore",
                                          "batch_mean", "none"])


class DistillConfig(BaseModel):
    """On-policy distillation (algo/distill.py): the teachers' per-token divergence from the student
    shapes the advantage (PG-style, `pg_coef` = lambda) and/or is a loss of its own mixed into the
    objective (GKD-style, `gkd_coef` = g; 1 is pure distillation and needs no task reward)."""
    model_config = ConfigDict(extra="forbid")
    pg_coef: float = Field(0.0, ge=0.0, description="lambda in A_t - lambda * d_t")
    pg_signal: Literal["k1", "topk_kl", "topk_fkl", "topk_jsd", "full_kl", "full_fkl", "full_jsd"] = Field(
        "k1", description="the divergence that shapes the advantage (k1: signed, sampled token)")
    gkd_coef: float = Field(0.0, ge=0.0, le=1.0, description="g in (1 - g) * L_RL + g * L_GKD")
    gkd_signal: Literal["k2", "k3", "topk_kl", "topk_fkl", "topk_jsd", "full_kl", "full_fkl", "full_jsd"] = Field(
        "k3", description="the divergence minimised as a loss (k1 has a zero-mean gradient on-policy: not offered)")
    top_k: int = Field(16, ge=1, description="teacher tokens per position for topk_* signals")

    @model_validator(mode="after")
    def _roles(self) -> DistillConfig:
        if self.pg_coef > 0 and self.gkd_coef == 1.0:
            raise ValueError("pg_coef > 0 with gkd_coef = 1: pure distillation has no RL advantage to shape")
        return self

    @property
    def active(self) -> bool:
        return self.pg_coef > 0 or self.gkd_coef > 0

    def signals(self) -> set[str]:
        return {s for s, c in ((self.pg_signal, self.pg_coef), (self.gkd_signal, self.gkd_coef)) if c > 0}

    @property
    def needs_top(self) -> str | None:
        """"topk" or "full" when a support-based signal is in use (the teachers return more than the
        sampled token's logprob), else None."""
        kinds = {s.split("_")[0] for s in self.signals() if "_" in s}
        return "full" if "full" in kinds else ("topk" if kinds else None)


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    clip_low: float = Field(0.2, ge=0.0)
    clip_high: float = Field(0.2, ge=0.0, description="> clip_low is DAPO's clip-higher")
    aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    is_mode: Literal["none", "metrics", "tis", "mis", "geo_mis"] = Field(
        "tis", description="behaviour -> proximal correction: truncated (tis), masked (mis), or masked by the "
                           "geometric mean of a sequence's token ratios (geo_mis, two-sided [is_low, is_cap])")
    is_level: Literal["token", "sequence"] = "token"
    is_cap: float = Field(2.0, gt=0.0, description="TIS truncation C; MIS upper bound")
    is_low: float = Field(0.5, ge=0.0, description="MIS lower bound")
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="sequence: GSPO, one clipped ratio per sequence (needs seq_mean_token_mean)")
    dual_clip: float | None = Field(None, gt=1.0, description="c of dual-clip PPO: for A < 0 the loss is at most -c A")
    m2po_threshold: float | None = Field(None, gt=0.0, description=(
        "M2PO: mask the tokens of largest squared log(proximal/behaviour) until the mean of the rest is at most this"))
    opsm_delta: float | None = Field(None, ge=0.0, description=(
        "OPSM: drop sequences with negative advantage whose per-token KL(behaviour || proximal) exceeds this"))
    max_version_lag: int | None = Field(None, ge=0, description=(
        "mask tokens produced more than this many versions before the trained one (partial rollouts)"))
    kl_coef: float = Field(0.0, ge=0.0)
    kl_estimator: KLEstimator = Field(
        "k3", description="k1 | k2 | k3 (Schulman), or module:attr of a (logprobs, ref_logprobs) -> per-token KL")
    policy_loss: PolicyLoss = Field(
        "ppo", description="ppo: the clipped decoupled objective with IS corrections (algo/losses.py), or module:attr "
                           "of a (PolicyInputs, LossConfig, denominator) -> (loss, metrics)")
    entropy_coef: float = Field(0.0, ge=0.0)
    distill: DistillConfig = DistillConfig()

    @model_validator(mode="after")
    def _bounds(self) -> LossConfig:
        if self.is_mode in ("mis", "geo_mis") and self.is_low >= self.is_cap:
            raise ValueError(f"is_low ({self.is_low}) must be below is_cap ({self.is_cap}) for masked IS")
        if self.ratio_level == "sequence" and self.aggregation != "seq_mean_token_mean":
            raise ValueError("ratio_level=sequence (GSPO) needs aggregation=seq_mean_token_mean (its gradient is "
                             "then exactly that of the sequence ratio)")
        return self


class AlgoConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    advantage: AdvantageEstimator = Field(
        "grpo", description="grpo (= group_zscore) | dr_grpo (= group_mean) | rloo | batch_zscore | batch_mean | none "
                            "(raw rewards), or module:attr of a (rewards [groups, n]) -> advantages")
    loss: LossConfig = LossConfig()
    mini_batches: int = Field(1, ge=1, description=(
        "optimizer steps per rollout batch (its rows split evenly); above 1 the proximal logprobs come from one "
        "pass before the first, so the PPO ratio moves off 1 and clipping acts"))
    epochs: int = Field(1, ge=1, description="passes over the rollout batch (each in `mini_batches` steps)")
    recompute_proximal: bool = Field(False, description=(
        "run a separate no-grad pass for the proximal logprobs before the update (verl/slime's old_log_prob). "
        "Off: one batch is one optimizer step, so the policy before the update is exactly the one in the "
        "update's own forward pass, whose detached logprobs serve; this saves a forward per step. Always on with "
        "mini_batches or epochs above 1, except for pure distillation (gkd_coef 1: no ratio to anchor)."))

    @property
    def needs_proximal_pass(self) -> bool:
        """Pure distillation (gkd_coef 1) has no PPO ratio to anchor: its mini-batches need no pass."""
        if self.recompute_proximal:
            return True
        pure_distillation = self.loss.distill.active and self.loss.distill.gkd_coef == 1.0
        return not pure_distillation and (self.mini_batches > 1 or self.epochs > 1)
