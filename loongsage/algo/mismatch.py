"""Train-inference gap: how far the engine's behaviour logprobs are from the trainer's."""
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
