"""The HF checkpoint folder every LoongSage component writes and reads: safetensors weights, the
source model's config and tokenizer files, and (for trainer checkpoints) the optimizer state."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch


def write_hf_folder(out: Path, weights: dict[str, torch.Tensor], model_path: str, trainer_state: dict | None) -> None:
    """An HF folder (loadable by engines and transformers) plus the trainer state (if given)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    for f in Path(model_path).iterdir():  # config, tokenizer, generation config, ...
        if f.is_file() and f.suffix not in (".safetensors", ".pt", ".bin") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    if trainer_state is not None:
        torch.save(trainer_state, out / "trainer_state.pt")
        (out / "loongsage_checkpoint.json").write_text(json.dumps({"version": trainer_state["version"]}))
