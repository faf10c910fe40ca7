"""Builds tiny models of real architectures (Qwen3 by default, Qwen2, Llama) from a seed.

The result is an ordinary HF folder (config, safetensors, tokenizer, generation config):
every code path that loads it is the one that loads a real checkpoint on a GPU cluster.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing import Literal
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from loongsage.models.tokenizer import EOS, IM_END, build_char_tokenizer



class TinyModelSpec(BaseModel):
    """Shape of a tiny model; the defaults are PROBES.md's 0.53M-parameter Qwen3 that learns addition."""

    model_config = ConfigDict(extra="forbid")
    arch: Literal["qwen3", "qwen2", "llama"] = "qwen3"
    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(512, ge=8)
    vocab_size: int = Field(128, ge=16)
    max_position_embeddings: int = Field(512, ge=16)
    tie_word_embeddings: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _heads(self) -> "TinyModelSpec":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        return self


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
