"""TrainBatch: samples collated into right-padded tensors aligned to next-token targets.

Column t of every [B, L-1] tensor scores token t+1 of `input_ids`, so a response token at
position p sits in column p-1. Shards for data-parallel ranks are padded with fully masked rows,
so every rank runs the same number of micro-batches (FSDP collectives must line up).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from loongsage.sample import Sample


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor  # [B, L] long
    loss_mask: torch.Tensor  # [B, L-1] float
    behavior_logprobs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B, L-1]
    proximal_logprobs: torch.Tensor | None = None  # [B, L-1], filled by the trainer
    ref_logprobs: torch.Tensor | None = None
    # distillation (algo/distill.py): M teachers, each sample's share of them, and what they scored
    teacher_logprobs: torch.Tensor | None = None  # [B, L-1, M]: of the sampled token
    teacher_top_ids: torch.Tensor | None = None  # [B, L-1, M, K] long
    teacher_top_logprobs: torch.Tensor | None = None  # [B, L-1, M, K]
    teacher_weights: torch.Tensor | None = None  # [B, M]; 0 where a teacher did not score the sample
    temperatures: torch.Tensor | None = None  # [B, L-1]: each target's sampling temperature (None: all 1)
    version_lag: torch.Tensor | None = None  # [B, L-1]: see version_lags

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> float:
        return float(self.loss_mask.sum())

    @property
    def num_sequences(self) -> float:
        return float((self.loss_mask.sum(dim=1) > 0).sum())

    def select(self, idx) -> TrainBatch:
        return TrainBatch(**{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[idx])
                             for f in fields(self)})

    def shards(self, n: int) -> list[TrainBatch]:
        """n equal-sized shards; missing rows are copies of row 0 with an all-zero loss mask."""
        per = -(-self.size // n)
        out = []
        for r in range(n):
            idx = list(range(r * per, min((r + 1) * per, self.size)))
            pad = per - len(idx)
            shard = self.select(idx + [0] * pad)
            if pad:
                shard.loss_mask[len(idx):] = 0.0
            out.append(shard)
        return out

    def trim(self, length: int) -> TrainBatch:
        """The first `length` positions (the rest is padding of every row)."""
        def cut(name: str, t: torch.Tensor | None):
            if t is None or name in _PER_ROW:
                return t
            return t[:, : length if name in _FULL_LENGTH else length - 1]
        return TrainBatch(**{f.name: cut(f.name, getattr(self, f.name)) for f in fields(self)})

    def micro_batches(self, size: int) -> list[tuple[list[int], TrainBatch]]:
        """(row indices, micro-batch) with rows sorted by length and each micro-batch trimmed to its
        own longest row: RL batches mix short answers with a few long (truncated) ones, and padding
        costs compute (a 256 x 14 batch of 9-token answers trains ~22% faster as 4 sorted x 64).
        Every rank gets the same count for the same shard size, so FSDP collectives line up."""
        lengths = self.attention_mask.sum(dim=1)
        order = torch.argsort(lengths, stable=True).tolist()
        out = []
        for i in range(0, self.size, size):
            idx = order[i: i + size]
            out.append((idx, self.select(idx).trim(max(2, int(lengths[idx].max())))))
        return out


_FULL_LENGTH = {"input_ids", "attention_mask"}  # [B, L]; the other tensors are [B, L-1, ...]
_PER_ROW = {"teacher_weights"}  # [B, M]: not along the sequence


def collate(samples: list[Sample], pad_id: int, teachers: list[str] | None = None, top_k: int = 0,
            trained_version: int | None = None) -> TrainBatch:
    """`teachers`: the distillation teachers' names (their scores, `Sample.teacher`, become the
    teacher tensors); `top_k`: how many top tokens per position each teacher returned (0: only the
    sampled token's logprob); `trained_version`: the version of the weights this batch updates
    (gives `version_lag`, which splits the gap metrics from the off-policy ones)."""
    L = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    B = len(samples)
    input_ids = np.full((B, L), pad_id, dtype=np.int64)
    attention = np.zeros((B, L), dtype=np.int64)
    for i, s in enumerate(samples):  # numpy row writes: a torch.tensor per row cost ~20 ms a 256-sample step
        n = len(s.prompt_ids) + len(s.response_ids)
        input_ids[i, : len(s.prompt_ids)] = s.prompt_ids
        input_ids[i, len(s.prompt_ids): n] = s.response_ids
        attention[i, : n] = 1
    input_ids, attention = torch.from_numpy(input_ids), torch.from_numpy(attention)

    def columns(values, fill: float = 0.0) -> torch.Tensor:
        return _response_columns(samples, L - 1, values, fill)
    batch = TrainBatch(input_ids, attention, columns(lambda s: s.loss_mask), columns(lambda s: s.behavior_logprobs),
                       columns(lambda s: [s.advantage] * len(s.response_ids)))
    if trained_version is not None:
        batch.version_lag = columns(lambda s: version_lags(s.versions, trained_version))
    if any(s.temperatures is not None for s in samples):
        batch.temperatures = columns(lambda s: s.temperatures, fill=1.0)
    if teachers:
        _teacher_tensors(batch, samples, teachers, top_k)
    return batch


def _response_columns(samples: list[Sample], width: int, values, fill: float) -> torch.Tensor:
    """[B, width] float: row i holds `values(samples[i])` (one per response token, or None) in the
    columns that score those tokens, `fill` everywhere else."""
    out = np.full((len(samples), width), fill, dtype=np.float32)
    for i, s in enumerate(samples):
        v = values(s)
        if v is not None and s.response_ids:
            lo = len(s.prompt_ids) - 1
            out[i, lo: lo + len(s.response_ids)] = v
    return torch.from_numpy(out)


def version_lags(versions: list[int], trained_version: int) -> list[int]:
    """Per response token: how many versions before the trained one the oldest policy that shaped
    it was. That is the oldest sampler of it or of any generated token before it: a request that
    lived through a weight update keeps the earlier version's KV cache, so even its newer tokens
    were drawn from a mix (inserted tokens, version -1, inherit the running value)."""
    out, oldest = [], None
    for v in versions:
        if v >= 0:
            oldest = v if oldest is None else min(oldest, v)
        out.append(max(trained_version - oldest, 0) if oldest is not None else 0)
    return out


def _teacher_tensors(batch: TrainBatch, samples: list[Sample], teachers: list[str], top_k: int) -> None:
    """Filled as numpy arrays, one tensor each at the end: torch.tensor of a nested list costs ~8x
    numpy's conversion, and full-vocabulary scores are [tokens x vocabulary] numbers a step."""
    B, T = batch.loss_mask.shape
    M = len(teachers)
    logprobs, weights = np.zeros((B, T, M), dtype=np.float32), np.zeros((B, M), dtype=np.float32)
    if top_k:
        top_ids = np.zeros((B, T, M, top_k), dtype=np.int64)
        top_lps = np.full((B, T, M, top_k), -1e4, dtype=np.float32)  # padding positions: no mass
    for i, s in enumerate(samples):
        lo = len(s.prompt_ids) - 1
        hi = lo + len(s.response_ids)
        for m, name in enumerate(teachers):
            scores = s.teacher.get(name)
            if scores is None or not s.response_ids:
                continue
            if len(scores.logprobs) != len(s.response_ids):
                raise ValueError(f"teacher {name!r} scored {len(scores.logprobs)} of {len(s.response_ids)} tokens")
            weights[i, m] = scores.weight
            logprobs[i, lo:hi, m] = scores.logprobs
            if top_k:
                if scores.top_ids is None or any(len(t) < top_k for t in scores.top_ids):
                    raise ValueError(f"teacher {name!r} returned fewer than top_k={top_k} tokens per position")
                top_ids[i, lo:hi, m] = [t[:top_k] for t in scores.top_ids]
                top_lps[i, lo:hi, m] = [t[:top_k] for t in scores.top_logprobs]
    batch.teacher_logprobs, batch.teacher_weights = torch.from_numpy(logprobs), torch.from_numpy(weights)
    if top_k:
        batch.teacher_top_ids, batch.teacher_top_logprobs = torch.from_numpy(top_ids), torch.from_numpy(top_lps)
