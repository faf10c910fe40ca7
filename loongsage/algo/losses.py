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

from loongsage.algo import offpolicy
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
    version_lag: torch.Tensor | None = None  # per token: versions between its sampler and the trained weights


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
    elif cfg.is_mode == "geo_mis":
        geo, keep, frac = offpolicy.geometric_mean_weights(proximal, behavior, mask, cfg.is_low, cfg.is_cap)
        applied = (geo * keep).expand_as(mask)
        metrics["is/geo_mask_frac"] = frac
    else:
        applied = torch.ones_like(w)
    return applied.detach(), metrics


def policy_loss(x: PolicyInputs, cfg: LossConfig, denominator: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO surrogate against proximal logprobs, with behaviour IS, KL and entropy terms."""
    mask = x.mask.float()
    n = mask.sum().clamp(min=1)
    log_ratio = x.logprobs - x.proximal_logprobs
    ratio = offpolicy.sequence_ratio(x.logprobs, x.proximal_logprobs, mask) if cfg.ratio_level == "sequence" \
        else torch.exp(log_ratio)
    unclipped = -x.advantages * ratio
    clipped = -x.advantages * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    metrics: dict[str, float] = {
        "loss/clip_frac": float(((clipped > unclipped).float() * mask).sum() / n),
        "loss/approx_kl": float((0.5 * log_ratio.detach() ** 2 * mask).sum() / n),
    }
    if cfg.dual_clip is not None:
        per_token, metrics["loss/dual_clip_frac"] = offpolicy.dual_clip(per_token, x.advantages, cfg.dual_clip, mask)
    per_token = per_token * _safeguard_keep(x, cfg, mask, metrics)
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


def _safeguard_keep(x: PolicyInputs, cfg: LossConfig, mask: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
    """1 where the selected safeguards (M2PO, OPSM, version lag) keep a token, else 0."""
    keep = torch.ones_like(mask)
    if cfg.m2po_threshold is not None:
        k, metrics["offpolicy/m2po_mask_frac"] = offpolicy.m2po_keep(x.proximal_logprobs, x.behavior_logprobs, mask,
                                                                      cfg.m2po_threshold)
        keep = keep * k
    if cfg.opsm_delta is not None:
        k, metrics["offpolicy/opsm_drop_frac"] = offpolicy.opsm_keep(x.proximal_logprobs, x.behavior_logprobs, mask,
                                                                      x.advantages, cfg.opsm_delta)
        keep = keep * k
    if cfg.max_version_lag is not None and x.version_lag is not None:
        k, metrics["offpolicy/lag_mask_frac"] = offpolicy.lag_keep(x.version_lag, mask, cfg.max_version_lag)
        keep = keep * k
    return keep.detach()


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, denominator: float | None = None
             ) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the masked tokens, token-mean."""
    mask = mask.float()
    loss = aggregate(-logprobs, mask, "token_mean", denominator)
    return loss, {"loss/sft": float(loss.detach())}
