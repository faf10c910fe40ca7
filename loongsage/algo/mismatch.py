"""Train-inference gap and off-policy drift, kept apart.

A token sampled by the version the trainer now holds differs from the trainer's logprob only by
numerics (kernels, dtype): that is the train-inference gap, `mismatch/*`. A token sampled by an
older version (async training, partial rollouts) also differs because the policy moved since:
that is off-policy drift, `offpolicy/*`, reported per version lag. Mixing them would show
staleness as a "gap"."""
from __future__ import annotations

import torch


def train_inference_gap(behavior: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`mismatch/kl` is the k1 estimate of KL(engine || trainer) on engine samples;
    `mismatch/abs_logprob_diff` the mean absolute per-token difference."""
    mask = mask.float()
    n = mask.sum().clamp(min=1)
    diff = (behavior - trainer) * mask
    return {"mismatch/kl": float(diff.sum() / n), "mismatch/abs_logprob_diff": float(diff.abs().sum() / n),
            "mismatch/max_abs_logprob_diff": float(diff.abs().max()) if mask.any() else 0.0}


def gap_and_drift(behavior: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor,
                  lag: torch.Tensor | None = None) -> dict[str, float]:
    """`mismatch/*` over tokens of lag 0 (the trainer's own version; all tokens when `lag` is None),
    `offpolicy/*` over older ones: KL(behaviour || trainer) (k1), the mean IS weight
    trainer/behaviour, and both per lag (`offpolicy/lag<n>/...`). Each group carries its token
    count (`<prefix>/tokens`), by which micro-batches are averaged; a group without tokens is left out."""
    mask = mask.float()
    if lag is None:
        lag = torch.zeros_like(mask)
    lag = lag.to(mask.device)
    out: dict[str, float] = {}
    current = mask * (lag == 0)
    if current.any():
        out.update(train_inference_gap(behavior, trainer, current))
        out["mismatch/tokens"] = float(current.sum())
    stale = mask * (lag > 0)
    groups = [("offpolicy", stale)] + [(f"offpolicy/lag{int(n)}", mask * (lag == n))
                                       for n in torch.unique(lag[stale > 0]).tolist()]
    for prefix, m in groups:
        if not m.any():
            continue
        n = m.sum()
        log_w = (trainer - behavior) * m
        out[f"{prefix}/kl"] = float(-log_w.sum() / n)
        out[f"{prefix}/is_weight_mean"] = float((torch.exp(log_w.clamp(max=20.0)) * m).sum() / n)
        out[f"{prefix}/tokens"] = float(n)
    return out
