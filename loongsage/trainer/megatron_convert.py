"""HF <-> Megatron-Core weights for the Qwen2 / Qwen3 / Llama families (Megatron's local layer spec).

A small mapping of our own (mbridge needs several workarounds here and megatron-bridge needs
Transformer Engine). Tensor-parallel layout, per decoder layer:
- `linear_qkv` (column parallel): rows interleaved per query group [q heads of the group, k, v];
  rank r holds a contiguous run of groups.
- `linear_fc1` (column parallel): [gate; up], each half split over ranks, so rank r holds
  [gate_r; up_r].
- `linear_proj`, `linear_fc2` (row parallel): split along the input dimension.
- embedding and output layer: split along the vocabulary; norms are replicated.
With the Transformer Engine layer spec (GPU) the two pre-norms are fused into the following linear
layer (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`); `te=True` uses those names.
The round trip HF -> Megatron shards -> HF is exact (tested).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED = ("qwen2", "qwen3", "llama")


@dataclass(frozen=True)
class Layout:
    arch: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    eps: float
    rope_theta: float
    max_positions: int

    @classmethod
    def from_hf(cls, config) -> Layout:
        arch = config.model_type
        if arch not in SUPPORTED:
            raise ValueError(f"trainer.backend=megatron: model_type {arch!r} is not supported; expected one of {SUPPORTED}")
        heads = config.num_attention_heads
        rope = getattr(config, "rope_theta", None) or (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(arch=arch, num_layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   ffn=config.intermediate_size, vocab=config.vocab_size,
                   tied=bool(getattr(config, "tie_word_embeddings", False)),
                   qkv_bias=arch == "qwen2" or bool(getattr(config, "attention_bias", False)),
                   qk_norm=arch == "qwen3", eps=config.rms_norm_eps, rope_theta=float(rope),
                   max_positions=config.max_position_embeddings)

    def check_parallel(self, tp: int, pp: int = 1) -> None:
        for what, n in (("num_key_value_heads", self.kv_heads), ("num_attention_heads", self.heads),
                        ("intermediate_size", self.ffn), ("vocab_size", self.vocab)):
            if n % tp:
                raise ValueError(f"trainer.tensor_parallel_size={tp} must divide the model's {what} ({n})")
        if self.num_layers % pp:
            raise ValueError(f"trainer.pipeline_parallel_size={pp} must divide the model's num_hidden_layers "
                             f"({self.num_layers})")

    def stage_layers(self, stage: int, stages: int) -> range:
        """Global indices of the decoder layers of pipeline stage `stage` (Megatron's even split)."""
        per = self.num_layers // stages
        return range(stage * per, (stage + 1) * per)


def _layer_map(i: int, local: int, lay: Layout, te: bool = False) -> dict[str, str]:
    """Megatron name (layer `local` of its stage) -> HF name (layer `i`) for tensors mapping one to one."""
    m, h = f"decoder.layers.{local}.", f"model.layers.{i}."
    pre_attn = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    pre_mlp = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    out = {m + pre_attn: h + "input_layernorm.weight",
           m + pre_mlp: h + "post_attention_layernorm.weight",
           m + "self_attention.linear_proj.weight": h + "self_attn.o_proj.weight",
           m + "mlp.linear_fc2.weight": h + "mlp.down_proj.weight"}
    if lay.qk_norm:
        out[m + "self_attention.q_layernorm.weight"] = h + "self_attn.q_norm.weight"
        out[m + "self_attention.k_layernorm.weight"] = h + "self_attn.k_norm.weight"
    return out


_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")


def _split(name: str, t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    if t.dim() == 1 and not name.endswith("linear_qkv.bias"):
        return t  # norms: replicated
    dim = 1 if name.endswith(_ROW_PARALLEL) else 0
    return t.chunk(tp, dim=dim)[rank].clone()


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: Layout) -> torch.Tensor:
    g, per, d = lay.kv_heads, lay.heads // lay.kv_heads, lay.head_dim
    tail = q.shape[1:]
    return torch.cat([q.reshape(g, per * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1) \
        .reshape(g * (per + 2) * d, *tail)


def _unqkv(qkv: torch.Tensor, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, per, d = lay.kv_heads, lay.heads // lay.kv_heads, lay.head_dim
    tail = qkv.shape[1:]
    x = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = x[:, : per * d], x[:, per * d: (per + 1) * d], x[:, (per + 1) * d:]
    return q.reshape(g * per * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)


def hf_to_megatron(hf: dict[str, torch.Tensor], lay: Layout, rank: int = 0, tp: int = 1,
                   stage: int = 0, stages: int = 1, te: bool = False) -> dict[str, torch.Tensor]:
    """The Megatron state dict of tensor-parallel rank `rank` (of `tp`) in pipeline stage `stage`
    (of `stages`; decoder layers numbered locally) from a full HF state dict."""
    first, last = stage == 0, stage == stages - 1
    out = {}
    if first:
        out["embedding.word_embeddings.weight"] = _split("embedding", hf["model.embed_tokens.weight"], rank, tp)
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not lay.tied:
            out["output_layer.weight"] = _split("output_layer", hf["lm_head.weight"], rank, tp)
        elif not first:  # tied, but the output layer lives on another stage: a copy, kept in sync by Megatron
            out["output_layer.weight"] = _split("output_layer", hf["model.embed_tokens.weight"], rank, tp)
    for local, i in enumerate(lay.stage_layers(stage, stages)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        for m_name, h_name in _layer_map(i, local, lay, te).items():
            out[m_name] = _split(m_name, hf[h_name], rank, tp)
        qkv = _qkv(hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"], hf[h + "self_attn.v_proj.weight"], lay)
        out[m + "self_attention.linear_qkv.weight"] = qkv.chunk(tp, dim=0)[rank].clone()
        if lay.qkv_bias:
            bias = _qkv(hf[h + "self_attn.q_proj.bias"], hf[h + "self_attn.k_proj.bias"], hf[h + "self_attn.v_proj.bias"], lay)
            out[m + "self_attention.linear_qkv.bias"] = bias.chunk(tp, dim=0)[rank].clone()
        gate, up = hf[h + "mlp.gate_proj.weight"].chunk(tp, dim=0), hf[h + "mlp.up_proj.weight"].chunk(tp, dim=0)
        out[m + "mlp.linear_fc1.weight"] = torch.cat([gate[rank], up[rank]], dim=0)
    return out


@dataclass(frozen=True)
class Rule:
    """HF tensors `outputs` built from the Megatron tensors `sources` (all tensor-parallel ranks)."""
    sources: tuple[str, ...]
    outputs: tuple[str, ...]
    kind: str  # "one": one tensor to one; "qkv": fused q/k/v; "fc1": fused gate/up


def export_rules(lay: Layout, stage: int = 0, stages: int = 1, te: bool = False) -> list[Rule]:
    """How pipeline stage `stage` turns its Megatron tensors into HF tensors, one rule per group of
    tensors that must be gathered together: what a bucket of HF names needs, and nothing more."""
    rules = []
    if stage == 0:
        rules.append(Rule(("embedding.word_embeddings.weight",), ("model.embed_tokens.weight",), "one"))
    if stage == stages - 1:
        rules.append(Rule(("decoder.final_layernorm.weight",), ("model.norm.weight",), "one"))
        if not lay.tied:
            rules.append(Rule(("output_layer.weight",), ("lm_head.weight",), "one"))
    for local, i in enumerate(lay.stage_layers(stage, stages)):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        rules += [Rule((m_name,), (h_name,), "one") for m_name, h_name in _layer_map(i, local, lay, te).items()]
        rules.append(Rule((m + "self_attention.linear_qkv.weight",),
                          tuple(h + f"self_attn.{x}_proj.weight" for x in "qkv"), "qkv"))
        if lay.qkv_bias:
            rules.append(Rule((m + "self_attention.linear_qkv.bias",),
                              tuple(h + f"self_attn.{x}_proj.bias" for x in "qkv"), "qkv"))
        rules.append(Rule((m + "mlp.linear_fc1.weight",), (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "fc1"))
    return rules


def apply_rules(rules: list[Rule], shards: list[dict[str, torch.Tensor]], lay: Layout) -> dict[str, torch.Tensor]:
    """The HF tensors of `rules`, from the Megatron tensors of all tensor-parallel ranks in rank order."""
    def cat(name: str) -> torch.Tensor:
        parts = [s[name] for s in shards]
        if parts[0].dim() == 1 and not name.endswith("linear_qkv.bias"):
            return parts[0].clone()
        return torch.cat(parts, dim=1 if name.endswith(_ROW_PARALLEL) else 0)

    out = {}
    for r in rules:
        if r.kind == "one":
            out[r.outputs[0]] = cat(r.sources[0])
        elif r.kind == "qkv":
            out.update(zip(r.outputs, _unqkv(cat(r.sources[0]), lay)))
        else:  # fc1: each rank holds [gate_r; up_r]
            halves = [s[r.sources[0]].chunk(2, dim=0) for s in shards]
            out.update(zip(r.outputs, (torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves]))))
    return out


def megatron_to_hf(shards: list[dict[str, torch.Tensor]], lay: Layout, stage: int = 0,
                   stages: int = 1, te: bool = False) -> dict[str, torch.Tensor]:
    """The HF tensors held by pipeline stage `stage`, from the Megatron state dicts of all its
    tensor-parallel ranks in rank order (no `lm_head.weight` when the embeddings are tied)."""
    return apply_rules(export_rules(lay, stage, stages, te), shards, lay)


def transformer_config(lay: Layout, tp: int, pp: int = 1, dtype: torch.dtype = torch.float32):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=lay.num_layers, hidden_size=lay.hidden, num_attention_heads=lay.heads,
        num_query_groups=lay.kv_heads, kv_channels=lay.head_dim, ffn_hidden_size=lay.ffn,
        normalization="RMSNorm", layernorm_epsilon=lay.eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=lay.qkv_bias, qk_layernorm=lay.qk_norm,
        attention_dropout=0.0, hidden_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp, use_cpu_initialization=True,
        perform_initialization=True,  # also marks the tensor-parallel params (grad norm, checkpoints)
        pipeline_model_parallel_size=pp, params_dtype=dtype, pipeline_dtype=dtype,
        variable_seq_lengths=True,  # micro-batches are trimmed to their own longest row
        moe_token_dispatcher_type="alltoall",  # (no MoE; the default dispatcher refuses variable lengths)
        calculate_per_token_loss=True)  # losses arrive divided by the global denominator: no averaging


def transformer_engine_available() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def build_gpt_model(lay: Layout, tp: int, pp: int = 1, stage: int = 0, te: bool = False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    spec = (specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=lay.qk_norm) if te
            else specs.get_gpt_layer_local_spec(qk_layernorm=lay.qk_norm))
    return GPTModel(transformer_config(lay, tp, pp), spec,
                    vocab_size=lay.vocab, max_sequence_length=lay.max_positions, position_embedding_type="rope",
                    rotary_base=lay.rope_theta, share_embeddings_and_output_weights=lay.tied,
                    pre_process=stage == 0, post_process=stage == pp - 1)
