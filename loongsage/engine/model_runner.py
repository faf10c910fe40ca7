"""Loads an HF causal LM for the engine and runs one flattened forward pass over KV slots.

Weight operations (load named tensors, release/resume memory) live here too, because they are
the only code that touches the model's parameters.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from loongsage.engine.kv_pool import ATTN_IMPL, BatchPlan, KVPool

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, model_path: str, dtype: str, device: str, slots: int, context_length: int | None):
        self.model_path = str(model_path)
        self.dtype, self.device = DTYPES[dtype], torch.device(device)
        config = AutoConfig.from_pretrained(model_path)
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, attn_implementation=ATTN_IMPL
        ).to(self.device).eval()
        self.vocab_size = config.vocab_size
        max_pos = getattr(config, "max_position_embeddings", None) or 4096
        self.context_length = min(context_length or max_pos, max_pos)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.pool = KVPool(config.num_hidden_layers, slots, kv_heads, self.context_length, head_dim, self.dtype, self.device)
        attached = 0
        for module in self.model.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
                module._loongsage_pool = self.pool
                attached += 1
        if attached != config.num_hidden_layers:
            raise ValueError(
                f"{model_path}: found {attached} attention modules for {config.num_hidden_layers} layers; "
                f"architecture {config.architectures} does not use transformers' AttentionInterface"
            )
        self._backup_dir: str | None = None

    # ---- forward -------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: list[int], positions: list[int], plan: BatchPlan, keep: list[int]) -> torch.Tensor:
        """Logits [len(keep), vocab] for the flattened tokens at the `keep` indices."""
        self.pool.plan = plan
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.tensor([positions], device=self.device)
        out = self.model(
            input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False,
            logits_to_keep=torch.tensor(keep, device=self.device),
        )
        self.pool.plan = None
        return out.logits[0]

    # ---- weights -------------------------------------------------------------------------
    def named_parameters(self) -> dict[str, torch.Tensor]:
        """Unique parameters and buffers by their state-dict name (tied weights appear once)."""
        return dict(self.model.named_parameters())

    def load_weights(self, named: list[tuple[str, torch.Tensor]] | dict) -> int:
        """Copies tensors into the parameters of the same names (casting dtype); returns count."""
        params = self.named_parameters()
        items = named.items() if isinstance(named, dict) else named
        count = 0
        with torch.no_grad():
            for name, tensor in items:
                target = params.get(name)
                if target is None:
                    if self._is_tied_alias(name):
                        continue
                    raise KeyError(f"unknown parameter {name!r}")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not match {tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                count += 1
        return count

    def _is_tied_alias(self, name: str) -> bool:
        return name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False)

    def load_from_disk(self, model_path: str) -> int:
        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {model_path}")
        count = 0
        for f in files:
            count += self.load_weights(load_file(str(f)))
        return count

    def parameter_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.named_parameters().values())

    def release_weights(self) -> None:
        """Frees the parameters' memory; a backup on disk (not RAM) restores them on resume."""
        if self._backup_dir is not None:
            return
        self._backup_dir = tempfile.mkdtemp(prefix="loongsage-weights-")
        params = self.named_parameters()
        save_file({k: v.detach().cpu().contiguous() for k, v in params.items()}, f"{self._backup_dir}/w.safetensors")
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def resume_weights(self) -> None:
        if self._backup_dir is None:
            return
        saved = load_file(f"{self._backup_dir}/w.safetensors")
        for name, p in self.named_parameters().items():
            p.data = saved[name].to(device=p.device, dtype=p.dtype)
        Path(f"{self._backup_dir}/w.safetensors").unlink()
        Path(self._backup_dir).rmdir()
        self._backup_dir = None

    @property
    def weights_released(self) -> bool:
        return self._backup_dir is not None
