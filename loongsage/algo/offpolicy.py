"""Off-policy safeguards as pure functions: what bounds an update made from samples of older
policies (async training, partial rollouts) or of a numerically different engine.

Tensors are [B, T] over response positions with `mask` marking trained tokens. `proximal` is the
trainer's policy before the update, `behavior` the engine's at sampling time. Each function returns
what the loss needs plus the fraction of tokens (or sequences) it acted on, for the metrics.

    dual-clip   for A < 0 the PPO loss is capped at -c * A (c > 1): a huge ratio on a bad token
                cannot blow the step up (Ye et al., 2020)
    GSPO        one ratio per sequence, the geometric mean of its token ratios, clipped as a whole
                (Zheng et al., 2025)
    geo-mean IS the sequence weight exp(mean_t(log proximal - log behaviour)); sequences outside
                [low, high] are masked (two-sided)
    M2PO        mask the tokens of largest squared log-ratio (proximal vs behaviour) until the mean
                over the rest is at most a threshold: only the outliers go
    OPSM        drop a sequence with negative advantage whose behaviour policy has drifted too far
                from the proximal one (k1 KL per token above delta): a stale failure says little
    lag mask    drop tokens produced more than n versions before the trained one (partial rollouts)
"""
from __future__ import annotations

import torch


def _frac(selected: torch.Tensor, mask: torch.Tensor) -> float:
    return float((selected.float() * mask).sum() / mask.sum().clamp(min=1))


def dual_clip(per_token_loss: torch.Tensor, advantages: torch.Tensor, c: float, mask: torch.Tensor
              ) -> tuple[torch.Tensor, float]:
    """The PPO loss max(-r A, -clip(r) A), capped at -c A where A < 0; and the fraction capped."""
    cap = -c * advantages
    capped = (advantages < 0) & (per_token_loss > cap)
    return torch.where(capped, cap, per_token_loss), _frac(capped, mask)


def sequence_ratio(logprobs: torch.Tensor, proximal: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ratio in token form [B, T]: every token's value is its sequence's
    s = exp(mean_t(log pi - log pi_prox)), and its gradient is s times the token's mean share of
    grad log pi (so with seq_mean_token_mean aggregation the gradient is exactly grad s * A)."""
    n = mask.sum(dim=1, keepdim=True).clamp(min=1)
    log_s = ((logprobs - proximal) * mask).sum(dim=1, keepdim=True) / n
    return torch.exp(log_s).detach() * torch.exp(logprobs - logprobs.detach())


def geometric_mean_weights(proximal: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, low: float,
                           high: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(weights [B, 1], keep [B, 1], fraction of sequences masked): the geometric mean of each
    sequence's token IS ratios, kept where low <= w <= high."""
    n = mask.sum(dim=1, keepdim=True)
    w = torch.exp(((proximal - behavior) * mask).sum(dim=1, keepdim=True) / n.clamp(min=1))
    keep = (w >= low) & (w <= high)
    has = n > 0
    return w, keep, float((~keep & has).sum() / has.sum().clamp(min=1))


def m2po_keep(proximal: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, threshold: float
              ) -> tuple[torch.Tensor, float]:
    """(keep [B, T], fraction masked): the fewest tokens of largest (log proximal - log behaviour)^2
    masked so that the mean of the rest is <= threshold."""
    sq = ((proximal - behavior) ** 2) * mask
    flat_mask = mask.flatten() > 0
    values = sq.flatten()[flat_mask]
    keep = torch.ones_like(mask, dtype=torch.bool)
    if values.numel() == 0 or float(values.mean()) <= threshold:
        return keep, 0.0
    order = torch.argsort(values, descending=True)
    ranked = values[order]
    n = values.numel()
    rest_sum = ranked.sum() - torch.cumsum(ranked, 0)  # after dropping the first k+1
    rest_n = torch.arange(n - 1, -1, -1, dtype=ranked.dtype)
    ok = (rest_sum <= threshold * rest_n) | (rest_n == 0)
    drop = int(torch.nonzero(ok)[0]) + 1
    positions = torch.nonzero(flat_mask).squeeze(1)[order[:drop]]
    flat_keep = keep.flatten().clone()
    flat_keep[positions] = False
    return flat_keep.view_as(mask), drop / n


def opsm_keep(proximal: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor,
              delta: float) -> tuple[torch.Tensor, float]:
    """(keep [B, 1], fraction of sequences dropped): a sequence goes when its advantage is negative
    and mean_t(log behaviour - log proximal), the k1 estimate of KL(behaviour || proximal) per
    token, exceeds delta."""
    n = mask.sum(dim=1, keepdim=True)
    kl = ((behavior - proximal) * mask).sum(dim=1, keepdim=True) / n.clamp(min=1)
    adv = (advantages * mask).sum(dim=1, keepdim=True) / n.clamp(min=1)
    drop = (adv < 0) & (kl > delta) & (n > 0)
    return ~drop, float(drop.sum() / (n > 0).sum().clamp(min=1))


def lag_keep(version_lag: torch.Tensor, mask: torch.Tensor, max_lag: int) -> tuple[torch.Tensor, float]:
    """(keep [B, T], fraction masked): tokens produced at most `max_lag` versions before the trained one."""
    keep = version_lag.to(mask.device) <= max_lag
    return keep, _frac(~keep, mask)
