"""Group-relative advantages. `rewards` is [groups, n]: n samples of the same prompt per row."""
from __future__ import annotations

import torch


def grpo(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(r - group mean) / (group std + eps), std with Bessel's correction as in GRPO."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    return (rewards - mean) / (std + eps)


def dr_grpo(rewards: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - group mean, no std normalisation (no difficulty bias)."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def rloo(rewards: torch.Tensor) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean of the other n-1 rewards."""
    n = rewards.shape[1]
    if n < 2:
        raise ValueError("RLOO needs at least 2 samples per prompt")
    return (rewards - rewards.mean(dim=1, keepdim=True)) * n / (n - 1)


def batch_zscore(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """(r - batch mean) / (batch std + eps): one baseline for every prompt of the step."""
    flat = rewards.flatten()
    std = flat.std() if flat.numel() > 1 else torch.zeros(())
    return (rewards - flat.mean()) / (std + eps)


def batch_mean(rewards: torch.Tensor) -> torch.Tensor:
    """r - batch mean."""
    return rewards - rewards.mean()


def raw(rewards: torch.Tensor) -> torch.Tensor:
    """No baseline, no normalisation: the reward itself (REINFORCE)."""
    return rewards.clone()


ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "rloo": rloo, "group_zscore": grpo, "group_mean": dr_grpo,
              "batch_zscore": batch_zscore, "batch_mean": batch_mean, "none": raw}


def compute(name: str, rewards: torch.Tensor) -> torch.Tensor:
    """A built-in estimator by name, or a user's (`module:attr` or registered; see extensions.py)."""
    from loongsage.extensions import resolve

    fn = ESTIMATORS.get(name) or resolve(name, "advantage")
    out = torch.as_tensor(fn(rewards), dtype=rewards.dtype)
    if out.shape != rewards.shape:
        raise ValueError(f"advantage estimator {name!r} returned shape {tuple(out.shape)} for rewards of shape "
                         f"{tuple(rewards.shape)}")
    return out


def keep_informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Dynamic sampling (DAPO): a [groups] bool mask, False where all rewards of a group are equal."""
    return (rewards.max(dim=1).values - rewards.min(dim=1).values) > 0
