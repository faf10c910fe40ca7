"""Random number generator states of a process (Python, NumPy, torch CPU and CUDA), saved with each
checkpoint per trainer rank and restored on resume, so that anything random on a rank (dropout, a
backend's sampling, a user's loss) continues the stream an uninterrupted run would have drawn."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_rng(folder: str | Path, rank: int) -> None:
    path = Path(folder) / "rng"
    path.mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path / f"rank{rank}.pt")


def load_rng(folder: str | Path, rank: int) -> bool:
    """Restores rank `rank`'s states if the checkpoint has them (older checkpoints do not)."""
    file = Path(folder) / "rng" / f"rank{rank}.pt"
    if not file.is_file():
        return False
    set_rng_state(torch.load(file, weights_only=False))
    return True
