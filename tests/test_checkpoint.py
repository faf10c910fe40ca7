"""Checkpoints a resume can trust: written under `.partial` and renamed, the tracker replaced last,
so a write that fails (here a real full disk: a 1 MiB tmpfs) leaves the previous checkpoint in
force; a resume refuses what it cannot continue, with the reason."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from loongsage.config import load_config
from loongsage.controller.checkpoint import ControllerState, latest_checkpoint, read_state, save_checkpoint
from loongsage.controller.sampler import PromptSampler
from loongsage.tasks.base import TaskRow


class WeightWriter:
    """Writes `size` bytes as the trainer's part of a checkpoint (the trainer's own save is covered
    by the end-to-end resume test)."""

    def __init__(self, size: int):
        self.size = size

    async def save(self, path: str) -> None:
        Path(path).mkdir(parents=True)
        with open(Path(path) / "model.safetensors", "wb") as f:
            f.write(os.urandom(self.size))
            f.flush()
            os.fsync(f.fileno())


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of 1 MiB (tmpfs), unmounted after."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a tmpfs")
    root = tmp_path / "disk"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    try:
        yield root
    finally:
        subprocess.run(["umount", str(root)], check=True)


def test_a_checkpoint_that_fills_the_disk_leaves_the_previous_one_in_force(small_disk):
    state = ControllerState(step=2, cursors={"default": 64}, teachers=[], seed=0)
    asyncio.run(save_checkpoint(small_disk, "step_2", state, WeightWriter(200_000)))
    assert latest_checkpoint(small_disk).name == "step_2"
    with pytest.raises(OSError) as err:  # 2 MB into what is left of 1 MiB
        asyncio.run(save_checkpoint(small_disk, "step_4", ControllerState(4, {"default": 128}, [], 0),
                                    WeightWriter(2_000_000)))
    assert err.value.errno == 28  # ENOSPC
    ckpt = latest_checkpoint(small_disk)
    assert ckpt.name == "step_2" and (ckpt / "model.safetensors").stat().st_size == 200_000
    assert not (small_disk / "checkpoints" / "step_4").exists()  # only step_4.partial, which nothing reads


def test_a_resume_refuses_what_it_cannot_continue(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        latest_checkpoint(tmp_path)
    asyncio.run(save_checkpoint(tmp_path, "step_2", ControllerState(2, {"default": 64}, ["math"], 0), WeightWriter(10)))
    (tmp_path / "checkpoints" / "latest").write_text("step_9\n")
    with pytest.raises(FileNotFoundError, match="names step_9, which is incomplete"):
        latest_checkpoint(tmp_path)
    ckpt = tmp_path / "checkpoints" / "step_2"
    with pytest.raises(ValueError, match=r"teachers \['math'\], the config has \[\]"):
        read_state(ckpt, load_config("recipes/arith_grpo.yaml", ["train.steps=10"]))
    (ckpt / "controller.json").write_text('{"step": 12, "cursors": {"default": 64}, "teachers": [], "seed": 0}')
    with pytest.raises(ValueError, match="at step 12; set train.steps above it"):
        read_state(ckpt, load_config("recipes/arith_grpo.yaml", ["train.steps=10"]))


def test_a_sampler_skipped_to_a_cursor_continues_as_the_original():
    rows = [TaskRow(prompt=str(i), answer=str(i)) for i in range(7)]
    original, resumed = PromptSampler(rows, seed=3), PromptSampler(rows, seed=3)
    original.take(10)
    resumed.skip_to(10)
    assert [r.prompt for r in original.take(9)] == [r.prompt for r in resumed.take(9)]
    with pytest.raises(ValueError, match="cannot go back"):
        resumed.skip_to(5)


def test_a_resume_removes_the_shared_buffers_of_the_attempt_that_died(tmp_path):
    """The run records its /dev/shm prefix; a later start removes that prefix's files (a killed
    controller's trainer ranks never free theirs) and nothing else, whatever the record says."""
    from loongsage.controller.runtime import SHM_RECORD, record_shm_prefix, remove_crashed_shm

    ours = [Path("/dev/shm") / f"loongsage-0badc0de-{i}" for i in range(2)]
    other = Path("/dev/shm") / "loongsage-0badc0df-0"
    try:
        for f in ours + [other]:
            f.write_bytes(b"x")
        for hostile in ("loongsage-", "loongsage-0badc0d*-", "../tmp/x", "loongsage-0badc0df-/../x"):
            (tmp_path / SHM_RECORD).write_text(hostile)
            assert remove_crashed_shm(tmp_path) == 0
        record_shm_prefix(tmp_path, "loongsage-0badc0de-")
        assert remove_crashed_shm(tmp_path) == 2
        assert not any(f.exists() for f in ours) and other.exists() and not (tmp_path / SHM_RECORD).exists()
        assert remove_crashed_shm(tmp_path) == 0  # no record: nothing to do
    finally:
        for f in ours + [other]:
            f.unlink(missing_ok=True)


def test_rng_states_round_trip_so_a_resumed_rank_draws_what_it_would_have(tmp_path):
    import random

    import numpy as np
    import torch

    from loongsage.trainer.rng import load_rng, save_rng

    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    save_rng(tmp_path, rank=1)
    expected = (torch.rand(4).tolist(), random.random(), np.random.rand())
    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # a new process's states
    assert load_rng(tmp_path, rank=1) and not load_rng(tmp_path, rank=0)
    assert (torch.rand(4).tolist(), random.random(), np.random.rand()) == expected


def test_a_resumed_run_logs_each_redone_step_once_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from loongsage.metrics import MetricsWriter

    first = MetricsWriter(tmp_path)
    for step in range(1, 6):  # the attempt that died after step 5, its last checkpoint at step 2
        first.write({"step": step, "reward/mean": float(step)})
    first.close()
    resumed = MetricsWriter(tmp_path, resumed_at=2)
    for step in (3, 4):
        resumed.write({"step": step, "reward/mean": 10.0 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
