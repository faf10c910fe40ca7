"""Builds tiny models of real architectures (Qwen3 by default, Qwen2, Llama) from a seed.

The result is an ordinary HF folder (config, safetensors, tokenizer, generation config):
every code path that loads it is the one that loads a real checkpoint on a GPU cluster.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from loongsage.models.config import TinyModelSpec
from loongsage.models.tokenizer import EOS, IM_END, build_char_tokenizer


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Creates (seeded, deterministic) and saves a model + char tokenizer into `out_dir`."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    tok = build_char_tokenizer(spec.max_position_embeddings)
    if len(tok) > spec.vocab_size:
        raise ValueError(f"vocab_size {spec.vocab_size} is smaller than the tokenizer ({len(tok)} tokens)")
    eos_ids = [tok.convert_tokens_to_ids(EOS), tok.convert_tokens_to_ids(IM_END)]
    config = AutoConfig.for_model(
        spec.arch,
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tok.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    transformers.logging.disable_progress_bar()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "loongsage_spec.json").write_text(json.dumps(spec.model_dump(), indent=1))
    return out
