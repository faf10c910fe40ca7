"""Resolves a run's model folder: a given HF path, or a tiny model built once and cached by spec."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from loongsage.models.config import ModelConfig
from loongsage.models.factory import build_tiny_model


def resolve_model(cfg: ModelConfig) -> Path:
    if cfg.path is not None:
        path = Path(cfg.path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {path} is not an HF model folder (no config.json)")
        return path.resolve()  # actors on other nodes do not share the controller's working directory
    digest = hashlib.sha256(json.dumps(cfg.tiny.model_dump(), sort_keys=True).encode()).hexdigest()[:10]
    path = Path(cfg.cache_dir).resolve() / f"tiny-{cfg.tiny.arch}-{digest}"
    if not (path / "model.safetensors").is_file():
        tmp = path.with_name(path.name + ".tmp")
        build_tiny_model(tmp, cfg.tiny)
        tmp.replace(path) if not path.exists() else None
    return path
