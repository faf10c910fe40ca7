"""Per-sequence KV slots and the attention function that reads them.

Why our own attention: continuous batching needs every running sequence to keep its own KV
(different lengths, joining and leaving at any step). Everything else in the forward pass
(embeddings, norms, rotary, MLP, projections) is the model's own transformers code; we register
one attention function with transformers' `AttentionInterface`, so any architecture that uses
that interface (Qwen3, Qwen2, Llama, Mistral, ...) runs unchanged.

Layout: for each layer, K and V are [slots, kv_heads, context_len, head_dim]. Running sequences
occupy slots 0..n-1 in order, so the decode step attends over one strided view `[:n, :, :L]`
without gathering. Finished sequences may stay in higher slots as prefix-cache entries.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

ATTN_IMPL = "loongsage_slots"


@dataclass
class Prefill:
    offset: int  # first index of this sequence's tokens in the flattened batch
    length: int  # new tokens in this step
    slot: int
    start: int  # tokens already in the slot (prefix reuse / resumed sequences)


@dataclass
class PrefillPack:
    """Prefills that start from an empty slot, attended in one call: their tokens side by side, each
    attending causally within its own sequence only."""
    rows: torch.Tensor  # [F] indices of the tokens in the flattened batch
    slots: torch.Tensor  # [F] the slot of each token
    pos: torch.Tensor  # [F] its position in the sequence
    seq: torch.Tensor  # [F] which prefill of the pack it belongs to


@dataclass
class PrefillBlock:
    """Prefills of the same length from an empty slot, attended as one [B, L] batch with a causal
    mask: no [F, F] mask over a pack, whose scores between different sequences are all wasted (500
    prompts of 8 tokens: 6 ms a layer against 38 ms in packs of 1024 tokens)."""
    rows: torch.Tensor  # [B * L] indices of the tokens in the flattened batch, sequence by sequence
    slots: torch.Tensor  # [B]
    length: int


PACK_TOKENS = 1024  # the [F, F] mask and scores of a pack stay small


@dataclass
class BatchPlan:
    """What one forward pass computes: `num_decode` one-token rows, then the prefills: those from an
    empty slot in blocks of equal length (one attention call each), the other lengths in packs (one
    call each), the rest (after a cached prefix) one by one."""

    num_decode: int
    decode_pos: torch.Tensor  # [num_decode] position of each decode row's new token
    prefills: list[Prefill]
    packs: list[PrefillPack] = field(default_factory=list)
    blocks: list[PrefillBlock] = field(default_factory=list)
    _masks: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        fresh = [p for p in self.prefills if p.start == 0]
        self.prefills = [p for p in self.prefills if p.start != 0]
        dev = self.decode_pos.device
        by_length: dict[int, list[Prefill]] = {}
        for p in fresh:
            by_length.setdefault(p.length, []).append(p)
        fresh = []
        for length, same in by_length.items():
            if len(same) == 1:
                fresh += same
                continue
            rows = torch.cat([torch.arange(p.offset, p.offset + length) for p in same])
            self.blocks.append(PrefillBlock(rows.to(dev), torch.tensor([p.slot for p in same], device=dev), length))
        fresh.sort(key=lambda p: p.offset)
        while fresh:
            group, total = [], 0
            while fresh and (not group or total + fresh[0].length <= PACK_TOKENS):
                total += fresh[0].length
                group.append(fresh.pop(0))
            rows = torch.cat([torch.arange(p.offset, p.offset + p.length) for p in group])
            self.packs.append(PrefillPack(
                rows.to(dev), torch.tensor([p.slot for p in group]).repeat_interleave(
                    torch.tensor([p.length for p in group])).to(dev),
                torch.cat([torch.arange(p.length) for p in group]).to(dev),
                torch.arange(len(group)).repeat_interleave(torch.tensor([p.length for p in group])).to(dev)))

    def decode_mask(self, window: int | None) -> torch.Tensor:
        key = ("decode", window)
        if key not in self._masks:
            L = int(self.decode_pos.max()) + 1
            cols = torch.arange(L, device=self.decode_pos.device)[None, :]
            ok = cols <= self.decode_pos[:, None]
            if window:
                ok &= cols > self.decode_pos[:, None] - window
            self._masks[key] = ok[:, None, None, :]
        return self._masks[key]

    def pack_mask(self, i: int, window: int | None) -> torch.Tensor:
        key = ("pack", i, window)
        if key not in self._masks:
            pack = self.packs[i]
            ok = (pack.seq[:, None] == pack.seq[None, :]) & (pack.pos[None, :] <= pack.pos[:, None])
            if window:
                ok &= pack.pos[None, :] > pack.pos[:, None] - window
            self._masks[key] = ok
        return self._masks[key]

    def block_mask(self, length: int, window: int | None, device) -> torch.Tensor | None:
        """None where a causal mask is all a block needs (no sliding window shorter than it)."""
        if not window or window >= length:
            return None
        return self.prefill_mask(Prefill(0, length, -1, 0), window, device)  # a fresh prefill's mask

    def prefill_mask(self, p: Prefill, window: int | None, device) -> torch.Tensor:
        key = (p.length, p.start, window)
        if key not in self._masks:
            rows = torch.arange(p.length, device=device)[:, None] + p.start
            cols = torch.arange(p.start + p.length, device=device)[None, :]
            ok = cols <= rows
            if window:
                ok &= cols > rows - window
            self._masks[key] = ok
        return self._masks[key]


class KVPool:
    def __init__(self, num_layers: int, slots: int, kv_heads: int, context_len: int, head_dim: int, dtype, device):
        self.shape = (slots, kv_heads, context_len, head_dim)
        self.num_layers, self.dtype, self.device = num_layers, dtype, device
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.plan: BatchPlan | None = None
        self.allocate()

    @property
    def slots(self) -> int:
        return self.shape[0]

    @property
    def context_len(self) -> int:
        return self.shape[2]

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    def allocate(self) -> None:
        self.k = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(self.shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    def free(self) -> None:
        self.k, self.v = [], []

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy(self, src: int, dst: int, length: int) -> None:
        for cache in (self.k, self.v):
            for t in cache:
                t[dst, :, :length] = t[src, :, :length]

    def copy_many(self, src: list[int], dst: list[int], length: int) -> None:
        """copy(src[i], dst[i], length) for all i in one gather and one index_copy_ per tensor (dst
        all distinct; every source is read before any destination is written)."""
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        for cache in (self.k, self.v):
            for t in cache:
                view = t[:, :, :length]  # index_copy_ on the view: ~3x faster than t[d, :, :n] = t[s, :, :n]
                view.index_copy_(0, d, view.index_select(0, s))

    def exchange(self, a: list[int], b: list[int], length: int) -> None:
        """Swaps the first `length` positions of slots a[i] and b[i] for all i (all distinct)."""
        self.copy_many(b + a, a + b, length)

    def swap(self, a: int, len_a: int, b: int, len_b: int) -> None:
        for cache in (self.k, self.v):
            for t in cache:
                tmp = t[a, :, :len_a].clone()
                t[a, :, :len_b] = t[b, :, :len_b]
                t[b, :, :len_a] = tmp


def slot_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over KV slots for the flattened batch [1, H, N, D] the model hands us."""
    pool: KVPool = module._loongsage_pool
    plan = pool.plan
    layer = module.layer_idx
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    K, V = pool.k[layer], pool.v[layer]
    q, k, v = query[0], key[0], value[0]  # [H, N, D], [kvh, N, D]
    H, N, D = q.shape
    kvh = k.shape[0]
    out = query.new_empty(N, H, D)
    nd = plan.num_decode
    if nd:
        rows = torch.arange(nd, device=q.device)
        K[rows, :, plan.decode_pos] = k[:, :nd].transpose(0, 1)
        V[rows, :, plan.decode_pos] = v[:, :nd].transpose(0, 1)
        L = int(plan.decode_pos.max()) + 1
        qd = q[:, :nd].transpose(0, 1).reshape(nd, kvh, H // kvh, D)
        o = F.scaled_dot_product_attention(
            qd, K[:nd, :, :L], V[:nd, :, :L], attn_mask=plan.decode_mask(window), scale=scaling
        )
        out[:nd] = o.reshape(nd, H, D)
    for block in plan.blocks:
        B, L = block.slots.numel(), block.length
        kb = k[:, block.rows].view(kvh, B, L, D).transpose(0, 1)  # [B, kvh, L, D]
        vb = v[:, block.rows].view(kvh, B, L, D).transpose(0, 1)
        K[block.slots, :, :L] = kb
        V[block.slots, :, :L] = vb
        mask = plan.block_mask(L, window, q.device)
        o = F.scaled_dot_product_attention(q[:, block.rows].view(H, B, L, D).transpose(0, 1), kb, vb, attn_mask=mask,
                                           is_causal=mask is None, scale=scaling, enable_gqa=kvh != H)
        out[block.rows] = o.transpose(1, 2).reshape(B * L, H, D)
    for i, pack in enumerate(plan.packs):
        kp, vp = k[:, pack.rows], v[:, pack.rows]
        K[pack.slots, :, pack.pos] = kp.transpose(0, 1)
        V[pack.slots, :, pack.pos] = vp.transpose(0, 1)
        o = F.scaled_dot_product_attention(q[None, :, pack.rows], kp[None], vp[None], attn_mask=plan.pack_mask(i, window),
                                           scale=scaling, enable_gqa=kvh != H)
        out[pack.rows] = o[0].transpose(0, 1)
    for p in plan.prefills:
        end = p.start + p.length
        K[p.slot, :, p.start:end] = k[:, p.offset:p.offset + p.length]
        V[p.slot, :, p.start:end] = v[:, p.offset:p.offset + p.length]
        o = F.scaled_dot_product_attention(
            q[None, :, p.offset:p.offset + p.length],
            K[p.slot, :, :end][None],
            V[p.slot, :, :end][None],
            attn_mask=plan.prefill_mask(p, window, q.device),
            scale=scaling,
            enable_gqa=kvh != H,
        )
        out[p.offset:p.offset + p.length] = o[0].transpose(0, 1)
    return out[None], None


AttentionInterface.register(ATTN_IMPL, slot_attention)
