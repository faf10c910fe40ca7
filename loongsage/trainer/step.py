"""What every training backend does the same way around its own forward/backward: per-token
logprobs from logits, the micro-batch loss (calling the pure functions of `loongsage.algo`), metric
reduction over micro-batches and ranks, and the LR schedule."""
from __future__ import annotations

import math

import torch

from loongsage.algo.config import LossConfig
from loongsage.algo.losses import PolicyInputs, policy_loss, sft_loss
from loongsage.algo.mismatch import train_inference_gap
from loongsage.extensions import resolve
from loongsage.trainer.batch import TrainBatch
from loongsage.trainer.config import TrainerConfig

ADDITIVE = {"loss/policy", "loss/sft"}  # summed over micro-batches and ranks
MAXIMAL = {"mismatch/max_abs_logprob_diff"}  # maximum over micro-batches and ranks; the rest are averaged


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Linear warm-up, then constant, linear or cosine decay to 0 at `total_steps`."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant" or not cfg.total_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return chosen, entropy


def wants_entropy(loss: str, loss_cfg: LossConfig | None) -> bool:
    return loss == "policy" and loss_cfg is not None and loss_cfg.entropy_coef > 0


def micro_batch_loss(lp: torch.Tensor, ent: torch.Tensor | None, mb: TrainBatch, loss: str,
                     loss_cfg: LossConfig | None, denominator: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch (a share of the global-denominator loss) and its metrics."""
    device = lp.device
    mask = mb.loss_mask.to(device)
    if loss == "sft":
        return sft_loss(lp, mask, denominator)
    if loss != "policy":
        raise ValueError(f"loss: expected 'policy' or 'sft', got {loss!r}")
    # No recomputed proximal logprobs: this forward runs the pre-update policy (one step per batch).
    proximal = lp.detach() if mb.proximal_logprobs is None else mb.proximal_logprobs.to(device)
    behavior = mb.behavior_logprobs.to(device)
    x = PolicyInputs(lp, proximal, behavior, mb.advantages.to(device), mask, ent,
                     None if mb.ref_logprobs is None else mb.ref_logprobs.to(device))
    loss_fn = policy_loss if loss_cfg.policy_loss == "ppo" else resolve(loss_cfg.policy_loss, "policy_loss")
    value, metrics = loss_fn(x, loss_cfg, denominator)
    metrics.update(train_inference_gap(behavior, proximal, mask))
    return value, metrics


class MetricSums:
    """Token-weighted averages over micro-batches (sums for ADDITIVE keys, maxima for MAXIMAL)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        for k, v in metrics.items():
            if k in MAXIMAL:
                self.sums[k] = max(self.sums.get(k, 0.0), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + (v if k in ADDITIVE else v * tokens)
            self.weights[k] = self.weights.get(k, 0.0) + tokens

    def result(self) -> dict[str, float]:
        return {k: (v if k in ADDITIVE | MAXIMAL else v / max(self.weights[k], 1e-9)) for k, v in self.sums.items()}
