"""Policy-gradient losses as pure functions over typed inputs; every loss returns its metrics.

Token-aligned tensors are [B, T] over response positions; `mask` marks trained tokens.
Off-policy handling follows the decoupled objective: the PPO ratio is taken against the
*proximal* logprobs (recomputed by the trainer before the update), and the gap between proximal
and *behaviour* logprobs (recorded by the engine at generation time) is corrected by importance
weights: truncated (TIS: min(w, C)) or masked (MIS: w outside [low, high] drops the token/sequence),
per token or per sequence. `is_mode: metrics` measures the weights without applying them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from loongsage.algo.config import LossConfig


@dataclass
class PolicyInputs:
    logprobs: torch.Tensor  # current policy, with grad
    proximal_logprobs: torch.Tensor  # trainer recompute before the update (no grad)
    behavior_logprobs: torch.Tensor  # engine, at generation time
    advantages: torch.Tensor  # per token (sequence advantage broadcast over its tokens)
    mask: torch.Tensor  # float {0, 1}
    entropy: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float | None = None) -> torch.Tensor:
    """Reduces [B, T] per-token values. `denominator` (tokens or sequences of the *global* batch)
    makes micro-batches and ranks add up to the full-batch loss; None uses this batch's own."""
    if mode == "token_mean":
        return (values * mask).sum() / (denominator if denominator is not None else mask.sum().clamp(min=1))
    per_seq = (values * mask).sum(dim=1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(dim=1).clamp(min=1)
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"aggregation: unknown mode {mode!r}")
    n_seq = (mask.sum(dim=1) > 0).float().sum().clamp(min=1)
    return per_seq.sum() / (denominator if denominator is not None else n_seq)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    from loongsage.extensions import resolve

    return resolve(estimator, "kl_estimator")(logprobs, ref_logprobs)


def importance_weights(proximal: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor,
                       cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Weights correcting behaviour -> proximal, per token [B, T], and their metrics."""
    log_w = (proximal - behavior) * mask
    if cfg.is_level == "sequence":
        log_w = log_w.sum(dim=1, keepdim=True).expand_as(mask)
    w = torch.exp(log_w.clamp(max=20.0))
    n = mask.sum().clamp(min=1)
    metrics = {"is/weight_mean": float((w * mask).sum() / n)}
    if cfg.is_mode == "tis":
        applied = w.clamp(max=cfg.is_cap)
        metrics["is/clip_frac"] = float(((w > cfg.is_cap).float() * mask).sum() / n)
    elif cfg.is_mode == "mis":
        keep = (w >= cfg.is_low) & (w <= cfg.is_cap)
        applied = w * keep
        metrics["is/mask_frac"] = float(((~keep).float() * mask).sum() / n)
    else:
        applied = torch.ones_like(w)
    return applied.detach(), metrics


def policy_loss(x: PolicyInputs, cfg: LossConfig, denominator: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate against proximal logprobs, with behaviour IS, KL and entropy terms."""
    mask = x.mask.float()
    n = mask.sum().clamp(min=1)
    log_ratio = x.logprobs - x.proximal_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics: dict[str, float] = {
        "loss/clip_frac": float(((clipped > unclipped).float() * mask).sum() / n),
        "loss/approx_kl": float((0.5 * log_ratio.detach() ** 2 * mask).sum() / n),
    }
    if cfg.is_mode != "none":
        w, is_metrics = importance_weights(x.proximal_logprobs, x.behavior_logprobs, mask, cfg)
        metrics.update(is_metrics)
        if cfg.is_mode != "metrics":
            per_token = per_token * w
    if cfg.kl_coef > 0:
        if x.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        kl = kl_penalty(x.logprobs, x.ref_logprobs, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        metrics["loss/kl_ref"] = float((kl.detach() * mask).sum() / n)
    if x.entropy is not None:
        metrics["loss/entropy"] = float((x.entropy.detach() * mask).sum() / n)
        if cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * x.entropy
    loss = aggregate(per_token, mask, cfg.aggregation, denominator)
    metrics["loss/policy"] = float(loss.detach())
    return loss, metrics


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, denominator: float | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the masked tokens, token-mean."""
    mask = mask.float()
    loss = aggregate(-logprobs, mask, "token_mean", denominator)
    return loss, {"loss/sft": float(loss.detach())}
