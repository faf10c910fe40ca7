"""What every training backend does the same way around its own forward/backward: per-token
logprobs from logits, the micro-batch loss (calling the pure functions of `loongsage.algo`), metric
reduction over micro-batches and ranks, and the LR schedule."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loongsage.algo import distill
from loongsage.algo.config import LossConfig
from loongsage.algo.losses import PolicyInputs, aggregate, policy_loss, sft_loss
from loongsage.algo.mismatch import gap_and_drift
from loongsage.extensions import resolve
from loongsage.trainer.batch import TrainBatch
from loongsage.trainer.config import TrainerConfig

ADDITIVE = {"loss/policy", "loss/sft"}  # summed over micro-batches and ranks (and every `.../tokens`)
MAXIMAL = {"mismatch/max_abs_logprob_diff"}  # maximum over micro-batches and ranks; the rest are averaged


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Linear warm-up, then constant, linear or cosine decay to 0 at `total_steps` (over its last
    `decay_steps` only, when set: a long constant stretch keeps learning fast and the decay settles the
    policy before the final evaluation)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant" or not cfg.total_steps:
        return 1.0
    decay = cfg.decay_steps or cfg.total_steps - cfg.warmup_steps
    progress = min(1.0, max(0.0, (step - (cfg.total_steps - decay)) / max(1, decay)))
    if cfg.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class TokenScores:
    """What a forward pass gives the loss: the logprob of each target token, its entropy (when the
    loss has an entropy term), and the student's logprobs at each teacher's top-k ids (distillation)."""
    logprobs: torch.Tensor  # [B, T]
    entropy: torch.Tensor | None = None  # [B, T]
    at_teacher_top: torch.Tensor | None = None  # [B, T, M, K]
    spared_positions: int = 0  # positions a shared prefix ran once for several rows (trainer/shared_prefix.py)


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool,
                 teacher_top_ids: torch.Tensor | None = None, temperatures: torch.Tensor | None = None) -> TokenScores:
    """Scores under the distribution each token was sampled from: logits / T per position."""
    logits = logits.float()
    if temperatures is not None:
        logits = logits / temperatures.to(logits.device).unsqueeze(-1)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    top = None
    if teacher_top_ids is not None:
        ids = teacher_top_ids.to(logp.device)
        b, t, m, k = ids.shape
        top = logp.gather(-1, ids.reshape(b, t, m * k)).reshape(b, t, m, k)
    return TokenScores(chosen, entropy, top)


def wants_entropy(loss: str, loss_cfg: LossConfig | None) -> bool:
    return loss == "policy" and loss_cfg is not None and loss_cfg.entropy_coef > 0


def micro_batch_loss(scores: TokenScores, mb: TrainBatch, loss: str, loss_cfg: LossConfig | None,
                     denominator: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one micro-batch (a share of the global-denominator loss) and its metrics."""
    lp = scores.logprobs
    device = lp.device
    mask = mb.loss_mask.to(device)
    if loss == "sft":
        return sft_loss(lp, mask, denominator)
    if loss != "policy":
        raise ValueError(f"loss: expected 'policy' or 'sft', got {loss!r}")
    # No recomputed proximal logprobs: this forward runs the pre-update policy (one step per batch).
    proximal = lp.detach() if mb.proximal_logprobs is None else mb.proximal_logprobs.to(device)
    behavior = mb.behavior_logprobs.to(device)
    advantages = mb.advantages.to(device)
    opd = loss_cfg.distill
    metrics: dict[str, float] = {}
    if opd.active and mb.teacher_weights is not None:
        per_signal = _divergences(opd.signals(), scores, mb, device)
        if opd.pg_coef > 0:
            advantages = distill.shaped_advantages(advantages, per_signal[opd.pg_signal], opd.pg_coef)
        for name, d in per_signal.items():
            metrics[f"distill/{name}_mean"] = float((d.detach() * mask).sum() / mask.sum().clamp(min=1))
    value = None
    if not (opd.active and opd.gkd_coef == 1.0):  # g = 1: pure distillation, no RL term
        x = PolicyInputs(lp, proximal, behavior, advantages, mask, scores.entropy,
                         None if mb.ref_logprobs is None else mb.ref_logprobs.to(device),
                         None if mb.version_lag is None else mb.version_lag.to(device))
        loss_fn = policy_loss if loss_cfg.policy_loss == "ppo" else resolve(loss_cfg.policy_loss, "policy_loss")
        value, rl_metrics = loss_fn(x, loss_cfg, denominator)
        metrics.update(rl_metrics)
    if opd.gkd_coef > 0 and mb.teacher_weights is not None:
        gkd = aggregate(per_signal[opd.gkd_signal], mask, loss_cfg.aggregation, denominator)
        metrics["loss/distill"] = float(gkd.detach())
        value = gkd * opd.gkd_coef if value is None else (1.0 - opd.gkd_coef) * value + opd.gkd_coef * gkd
    if value is None:
        raise ValueError("algo.loss.distill.gkd_coef = 1 needs teacher scores in the batch (no teacher scored it)")
    metrics.update(gap_and_drift(behavior, proximal, mask, mb.version_lag))
    return value, metrics


def _divergences(kinds: set[str], scores: TokenScores, mb: TrainBatch, device) -> dict[str, torch.Tensor]:
    """Per token [B, T]: each signal, mixed over the sample's teachers by their weights."""
    weights = mb.teacher_weights.to(device)
    teacher_lp = mb.teacher_logprobs.to(device)
    teacher_top = None if mb.teacher_top_logprobs is None else mb.teacher_top_logprobs.to(device)
    return {k: distill.mix(distill.signal(k, scores.logprobs, teacher_lp, scores.at_teacher_top, teacher_top), weights)
            for k in kinds}


def is_additive(key: str) -> bool:
    return key in ADDITIVE or key.endswith("/tokens")


def combine_metrics(parts: list[dict[str, float]], additive_divisor: float = 1.0) -> dict[str, float]:
    """Metrics of several parts of one update (ranks, or mini-batches) as one: maxima for MAXIMAL
    keys, sums for additive ones and `train/tokens` (divided by `additive_divisor`: epochs, which see
    the same tokens again), plain means for the rest; every key any part reported."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        vals = [part[key] for part in parts if key in part]
        if key in MAXIMAL:
            out[key] = max(vals)
        elif is_additive(key) or key == "train/tokens":
            out[key] = sum(vals) / additive_divisor
        else:
            out[key] = sum(vals) / len(vals)
    return out


class MetricSums:
    """Token-weighted averages over micro-batches (sums for additive keys, maxima for MAXIMAL). A
    metric over a subset of the tokens is weighted by its group's `<prefix>/tokens` when given."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, float], tokens: float) -> None:
        for k, v in metrics.items():
            w = metrics.get(k.rsplit("/", 1)[0] + "/tokens", tokens)
            if k in MAXIMAL:
                self.sums[k] = max(self.sums.get(k, 0.0), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + (v if is_additive(k) else v * w)
            self.weights[k] = self.weights.get(k, 0.0) + w

    def result(self) -> dict[str, float]:
        return {k: (v if is_additive(k) or k in MAXIMAL else v / max(self.weights[k], 1e-9))
                for k, v in self.sums.items()}
