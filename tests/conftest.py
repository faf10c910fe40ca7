"""Shared fixtures: tiny models built once per session, and real engine servers on 127.0.0.1."""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

from loongsage.models.config import TinyModelSpec
from loongsage.models.factory import build_tiny_model
from loongsage.rollout.launcher import launch_engine

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """Qwen3 with GQA (4 query heads, 2 KV heads), seed 0."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-a"), TinyModelSpec(num_kv_heads=2, seed=0)))


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory) -> str:
    """Same architecture as `tiny_model`, different weights (seed 1)."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-b"), TinyModelSpec(num_kv_heads=2, seed=1)))


@pytest.fixture(scope="session")
def long_model(tmp_path_factory) -> str:
    """Like `tiny_model` with 4096 positions: a request long enough (~10 s) to be cut short."""
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-long"), TinyModelSpec(max_position_embeddings=4096)))


@pytest.fixture(scope="session")
def engine(tiny_model, tmp_path_factory):
    """May load weight folders from anywhere under the session's temporary folder (the other models)."""
    roots = ["--weight-roots", str(tmp_path_factory.getbasetemp())]
    with launch_engine(tiny_model, extra_args=["--max-running", "16", "--context-length", "256", *roots]) as ep:
        yield ep


@pytest.fixture(scope="session")
def engine_b(tiny_model_b):
    with launch_engine(tiny_model_b, extra_args=["--max-running", "16", "--context-length", "256"]) as ep:
        yield ep


@pytest.fixture(scope="session")
def ray_session():
    """Ray started once for the whole test session, on 127.0.0.1."""
    import ray

    from loongsage.cluster.config import RayConfig
    from loongsage.cluster.ray_setup import init_ray

    started = init_ray(RayConfig(num_cpus=2))
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> str:
    from helpers import scripted_tool_model

    return scripted_tool_model(str(tmp_path_factory.mktemp("tool-model")))


@pytest.fixture(scope="session")
def tool_engine(tool_model):
    with launch_engine(tool_model, extra_args=["--max-running", "16", "--context-length", "512"]) as ep:
        yield ep


def _cache_root(tmp_path_factory, name: str):
    """A fresh folder for the session, or, where LOONGSAGE_TEST_CACHE names a folder, one kept across
    sessions there (a developer timing one heavy test need not rebuild its bootstrap each time; CI
    never sets it, so every bootstrap is built from scratch there)."""
    keep = os.environ.get("LOONGSAGE_TEST_CACHE")
    if not keep:
        return tmp_path_factory.mktemp(name)
    root = Path(keep) / name
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def calc_caches(tmp_path_factory):
    """Bootstrap, model and data caches shared by every run on the calculator task in this session:
    the agent recipes' bootstrap (SFT on tool demonstrations) is built once, by whichever test needs
    it first."""
    root = _cache_root(tmp_path_factory, "calc-caches")
    return root, {"bootstrap": root / "base", "models": root / "models", "data": root / "data"}


@pytest.fixture(scope="session")
def arith_caches(tmp_path_factory):
    """Bootstrap, model and data caches of every short arithmetic run in this session (the
    bootstrap SFT runs once, in whichever test needs it first)."""
    root = _cache_root(tmp_path_factory, "e2e")
    return [f"bootstrap.cache_dir={root / 'base'}", f"model.cache_dir={root / 'models'}",
            f"task.data_dir={root / 'data'}"], root
