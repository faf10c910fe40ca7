"""Per-row sampling for a ragged decode batch: temperature, top-k, top-p, min-p, seeds.

Rows carry their own parameters, so one request's settings never leak into another's.
Returned logprobs are those of the temperature-scaled distribution before top-k/top-p/min-p
filtering (SGLang's default), or of the raw logits for greedy rows (temperature 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: logprob of the chosen token
    top_ids: torch.Tensor | None  # [B, k] when top logprobs were asked for
    top_logprobs: torch.Tensor | None


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    top_logprobs_num: int = 0,
) -> SampleResult:
    """Samples one token per row of `logits` [B, V] with that row's parameters."""
    logits = logits.float()
    B, V = logits.shape
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
    logprobs_all = torch.log_softmax(logits / temps[:, None], dim=-1)
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    tokens = logprobs_all.argmax(dim=-1)
    if not bool(greedy.all()):
        probs = logprobs_all.exp()
        needs_filter = any((p.top_p < 1.0 or p.top_k > 0 or p.min_p > 0.0) for p in params)
        if needs_filter:
            probs = _filter(probs, params)
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), V, device=logits.device).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                noise[i] = torch.empty(V, device=logits.device).exponential_(generator=g)
        # Exponential race: argmax p/E with E ~ Exp(1) draws from p / sum(p) (zeros never win).
        sampled = (probs / noise).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)
    chosen = logprobs_all.gather(1, tokens[:, None]).squeeze(1)
    top_ids = top_lp = None
    if top_logprobs_num > 0:
        top_lp, top_ids = logprobs_all.topk(min(top_logprobs_num, V), dim=-1)
    return SampleResult(tokens, chosen, top_ids, top_lp)


def _filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zeroes the tokens that top-k, top-p or min-p exclude, row by row."""
    dev = probs.device
    V = probs.shape[-1]
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=dev)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=dev)[None, :]
    drop = rank >= top_k[:, None]
    drop |= (sorted_p.cumsum(dim=-1) - sorted_p) > top_p[:, None]
    drop |= sorted_p < (min_p[:, None] * sorted_p[:, :1])
    drop[:, 0] = False  # the most likely token always survives
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)
