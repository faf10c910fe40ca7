"""A short RL run through the real controller: Ray, trainer actor (FSDP2), engine actor, weight
sync, bootstrap SFT, evaluation, metrics, checkpoint and plot. Rewards must rise."""
from __future__ import annotations

import asyncio
import json

import pytest

from helpers import ListeningSockets, processes_mentioning, undocumented_metrics
from loongsage.config import load_config
from loongsage.controller.train import train
from loongsage.metrics import REQUIRED, read_metrics
from loongsage.plot import plot_run
from loongsage.validation.check import check_run

RECIPE = load_config("recipes/arith_grpo.yaml")
EASY = RECIPE.quick.overrides  # the recipe's short form (`loongsage validate --quick`)


@pytest.fixture
def shared(arith_caches):
    return arith_caches


BACKENDS = {"fsdp": [], "megatron_tp2": ["trainer.backend=megatron", "trainer.world_size=2",
                                          "trainer.tensor_parallel_size=2", "trainer.threads=1"],
            "fsdp_colocated": ["placement.mode=colocated"]}


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_grpo_run_through_the_controller_raises_reward(ray_session, tmp_path, shared, backend):
    cfg = load_config("recipes/arith_grpo.yaml", EASY + shared[0] + BACKENDS[backend] + [f"run_dir={tmp_path / 'run'}"])
    summary = asyncio.run(train(cfg))
    records = read_metrics(tmp_path / "run")
    assert records[0]["step"] == 0 and "eval/accuracy" in records[0]
    steps = [r for r in records if r["step"] > 0 and "reward/mean" in r]
    assert len(steps) == 100
    for r in steps:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert not r["samples/trained"] or r["mismatch/abs_logprob_diff"] < 1e-4  # fp32 both sides: no gap
        assert r["staleness/max"] == 0  # synchronous loop
    # the recipe's settings: +0.06 between these windows in a full run; 20-step means are +-0.01
    first = sum(r["reward/mean"] for r in steps[:20]) / 20
    last = sum(r["reward/mean"] for r in steps[-20:]) / 20
    assert last > first + 0.02, (first, last)
    checks = check_run(tmp_path / "run", RECIPE.quick.expect)  # what `loongsage validate --quick` checks
    assert all(c.passed for c in checks), checks
    assert not undocumented_metrics(records), "explain them in docs/metrics.md"
    assert any(r["samples/filtered_groups"] > 0 for r in steps)  # dynamic sampling dropped all-equal groups
    # where the engine's time went, per step: its parts add up to its busy time; a group's 8 samples
    # prefill their prompt once (the others copy its K/V, counted as cached; a group that max_running
    # splits over two engine steps prefills twice)
    for r in steps[1:]:
        parts = sum(r[f"engine/{k}"] for k in ("prefill_s", "decode_s", "sample_s", "schedule_s"))
        assert abs(parts - r["engine/busy_s"]) <= 1e-6 + 1e-3 * r["engine/busy_s"], r
        assert r["engine/http_s"] > 0 and r["engine/decode_s"] > 0 and r["engine/generated_tokens"] > 0
        if "eval/accuracy" not in r:  # greedy evaluation requests are single samples
            assert 0 < 4 * r["engine/prefill_tokens"] <= r["engine/cached_tokens"], r
    trace = json.loads((tmp_path / "run" / "timeline.json").read_text())["traceEvents"]
    split = [e for e in trace if e.get("ph") == "C" and e["name"].startswith("engines: time split")]
    assert len(split) == 100 and {"prefill_s", "decode_s", "schedule_s", "http_s"} <= set(split[-1]["args"])
    tracks = {e["tid"]: e["args"]["name"] for e in trace if e.get("ph") == "M"}
    startup = [e["name"] for e in trace if e.get("ph") == "X" and tracks[e["tid"]] == "start-up"]  # where it went
    assert startup == ["Ray", "placement group", "trainer ranks, engines", "TransferMesh", "data sources, rollouts"]
    # no group is admitted while the held-out rows are evaluated (from before the weights they wait for)
    evals = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("ph") == "X" and tracks[e["tid"]] == "eval"]
    generating = [e["ts"] for e in trace if e.get("ph") == "X" and tracks[e["tid"]] == "engines: generate"]
    assert len(evals) == 3 and not [t for t in generating for a, b in evals if a <= t <= b]
    if backend == "fsdp_colocated":  # every train step ran while the engine had released its memory
        released = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("name") == "released"]
        trains = [(e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("ph") == "X" and e["name"].startswith("train ")]
        assert len(trains) == 100 and all(any(a <= s and e <= b for a, b in released) for s, e in trains)
        assert all(r["time/colocate_release_s"] > 0 and r["time/colocate_resume_s"] > 0 for r in steps)
    assert "eval/accuracy" in steps[-1] and summary["eval_after"] == steps[-1]["eval/accuracy"]
    assert (tmp_path / "run" / "checkpoints" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "config.yaml").is_file()
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    png = plot_run(tmp_path / "run")
    assert png.stat().st_size > 10_000
    boot = json.loads(next((shared[1] / "base").glob("*/sft.json")).read_text())
    assert boot["dev_accuracy"] >= 0.25


@pytest.mark.slow
def test_async_run_keeps_every_sample_inside_the_window(ray_session, tmp_path, shared):
    """k = 2 with a bf16 engine and an fp32 trainer: generation runs ahead of training, no trained
    sample is ever staler than k, and the real train-inference gap is measured and corrected (TIS)."""
    cfg = load_config("recipes/arith_grpo.yaml", EASY + shared[0] + [
        f"run_dir={tmp_path / 'run'}", "rollout.max_staleness=2", "engine.dtype=bfloat16",
        "algo.loss.is_mode=tis", "train.steps=30", "train.eval_every=30", "trainer.threads=1",
        "rollout.engine_threads=1"])
    with ListeningSockets() as sockets:
        asyncio.run(train(cfg))
    # nothing of the run (Ray, trainer ranks, engines, their weight sync) listens beyond loopback
    assert len(sockets.seen) >= 5 and not sockets.beyond_loopback(), sockets.seen
    steps = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0 and "reward/mean" in r]
    assert len(steps) == 30
    assert all(r["staleness/max"] <= 2 for r in steps)
    assert max(r["staleness/max"] for r in steps) >= 1  # generation really ran ahead
    # null: no token of the trained version in the step (nothing trained, or only older tokens)
    gaps = [r["mismatch/abs_logprob_diff"] for r in steps if r["mismatch/abs_logprob_diff"] is not None]
    assert gaps and min(gaps) > 1e-4  # bf16 engine vs fp32 trainer
    assert any(r.get("offpolicy/lag1/tokens", 0) > 0 for r in steps)  # older tokens are reported apart
    assert all("is/clip_frac" in r and r["is/weight_mean"] > 0 for r in steps)
    assert all(r["samples/cancelled"] >= 0 and r["samples/dropped_stale"] >= 0 for r in steps)
    assert all(sum(v for k, v in r.items() if k.startswith("staleness/hist/")) == r["samples/trained"] for r in steps)


@pytest.mark.slow
def test_the_long_output_recipe_quick_form_validates(ray_session, tmp_path, shared):
    """recipes/count_grpo.yaml as `loongsage validate --quick` runs it: outputs of 2-128 tokens,
    async k = 1 with the trainer and the engine on a core each."""
    recipe = load_config("recipes/count_grpo.yaml")
    cfg = load_config("recipes/count_grpo.yaml", recipe.quick.overrides + shared[0] + [f"run_dir={tmp_path / 'run'}"])
    asyncio.run(train(cfg))
    checks = check_run(tmp_path / "run", recipe.quick.expect)
    assert all(c.passed for c in checks), checks
    steps = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0 and "reward/mean" in r]
    assert len(steps) == 20 and not undocumented_metrics(steps)
    # long outputs: ~20-40 tokens a sample on average here (arithmetic answers: 2-4)
    per_sample = [r["engine/generated_tokens"] / (16 * 8) for r in steps[1:] if "eval/accuracy" not in r]
    assert sum(per_sample) / len(per_sample) > 10, per_sample


@pytest.mark.slow
def test_steps_with_nothing_to_train_advance_version_and_schedule_and_send_no_weights(ray_session, tmp_path):
    """An untrained model never solves 3-digit addition: every group's rewards are equal, so every
    step is skipped. The trainer's version and LR warm-up still advance with the run's steps, the
    engines only relabel their weights (no bytes), and the weights end exactly as they began."""
    import torch
    from safetensors.torch import load_file

    cfg = load_config("recipes/arith_grpo.yaml", [
        f"run_dir={tmp_path / 'run'}", f"model.cache_dir={tmp_path / 'models'}", f"task.data_dir={tmp_path / 'data'}",
        "bootstrap.enabled=false", "model.tiny.max_position_embeddings=32", "task.params.digits=3",
        "task.train_size=64", "task.eval_size=8", "engine.context_length=32", "sampling.max_new_tokens=4",
        "sampling.n=4", "rollout.prompts_per_step=4", "trainer.warmup_steps=4", "trainer.lr=1e-3",
        "train.steps=3", "train.eval_every=3", "train.max_minutes=null", "trainer.threads=1",
        "rollout.engine_threads=1"])
    asyncio.run(train(cfg))
    steps = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0 and "reward/mean" in r]
    assert [r["train/skipped_no_signal"] for r in steps] == [1.0, 1.0, 1.0]
    assert all(r["weight_sync/bytes"] == 0 for r in steps)
    assert [round(r["train/lr"], 6) for r in steps] == [2.5e-4, 5e-4, 7.5e-4]  # warm-up: (k + 1) / 4 at step k + 1
    final = tmp_path / "run" / "checkpoints" / "final"
    assert torch.load(final / "trainer_state.pt", weights_only=False)["version"] == 3
    start = load_file(str(next((tmp_path / "models").glob("*/model.safetensors"))))
    end = load_file(str(final / "model.safetensors"))
    assert all(torch.equal(start[k], end[k]) for k in start)


@pytest.mark.slow
def test_a_resumed_run_continues_as_if_never_stopped(ray_session, tmp_path, shared):
    """A synchronous run of 4 steps checkpoints at step 2; the same run cut there (what a crash
    after step 2 leaves: checkpoint step_2 named by the tracker, later metrics and ledger lines) and resumed
    with `--resume`'s path gives the same steps 3 and 4 (same prompts, same seeded samples: seeded_sampling, same
    optimizer state) and the same final weights, to float tolerance."""
    import shutil

    import torch
    from safetensors.torch import load_file

    from loongsage.controller.checkpoint import latest_checkpoint
    from loongsage.controller.ledger import read_ledger

    common = EASY + shared[0] + ["rollout.dynamic_sampling=false", "rollout.seeded_sampling=true", "train.steps=4",
                                 "train.eval_every=2", "train.save_every=2", "trainer.threads=1", "rollout.engine_threads=1"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    asyncio.run(train(load_config("recipes/arith_grpo.yaml", common + [f"run_dir={full}"])))
    assert latest_checkpoint(full).name == "final"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "config.yaml", cut / "config.yaml")
    shutil.copytree(full / "checkpoints" / "step_2", cut / "checkpoints" / "step_2")
    (cut / "checkpoints" / "latest").write_text("step_2\n")
    for name in ("metrics.jsonl", "prompts.jsonl"):  # written on after the checkpoint: the resume cuts them back
        shutil.copy(full / name, cut / name)
    summary = asyncio.run(train(load_config(str(cut / "config.yaml"), [f"run_dir={cut}"]), resume=True))

    a = [r for r in read_metrics(full) if r["step"] > 0 and "reward/mean" in r]
    b = [r for r in read_metrics(cut) if r["step"] > 0 and "reward/mean" in r]
    assert [r["step"] for r in b] == [1, 2, 3, 4] and summary["eval_before"] == read_metrics(full)[0]["eval/accuracy"]
    compared = ["reward/mean", "samples/trained", "train/lr", "eval/accuracy"] + [k for k in a[2] if k.startswith("loss/")]
    for ra, rb in zip(a[2:], b[2:]):
        assert rb["version"] == ra["version"]
        for k in compared:
            if k in ra:
                assert rb[k] == pytest.approx(ra[k], abs=1e-5), (ra["step"], k, ra[k], rb[k])
    wa = load_file(str(full / "checkpoints" / "final" / "model.safetensors"))
    wb = load_file(str(cut / "checkpoints" / "final" / "model.safetensors"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)
    assert torch.load(cut / "checkpoints" / "final" / "trainer_state.pt", weights_only=False)["version"] == 4
    la, lb = read_ledger(full / "prompts.jsonl"), read_ledger(cut / "prompts.jsonl")
    assert [(x["cursor"], x["fate"], x["step"]) for x in la if x["fate"] == "trained"] == \
        [(x["cursor"], x["fate"], x["step"]) for x in lb if x["fate"] == "trained"]
    assert sorted(x["cursor"] for x in lb) == list(range(len(lb)))  # every prompt drawn has one fate


@pytest.mark.slow
def test_an_async_run_killed_and_resumed_settles_every_prompt_once(ray_session, tmp_path, shared):
    """`loongsage train` (k = 1) is SIGKILLed once its step-4 checkpoint is complete, then
    `loongsage train --resume`: the ledger gives every prompt drawn exactly one fate, what it calls
    trained is what the metrics trained, each step is in the metrics once, and nothing of the killed
    run is left running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from loongsage.controller.ledger import read_ledger

    run = tmp_path / "run"
    shm_before = set(os.listdir("/dev/shm"))
    # each command starts its own local Ray, in its own session: SIGKILL to the session ends it all
    cfg = EASY + shared[0] + [f"run_dir={run}", "rollout.max_staleness=1", "train.steps=8", "train.save_every=2",
                                     "train.eval_every=8", "trainer.threads=1", "rollout.engine_threads=1"]
    log = open(tmp_path / "killed.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "loongsage.cli", "train", "recipes/arith_grpo.yaml", *cfg],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    tracker, deadline = run / "checkpoints" / "latest", time.time() + 900
    while not (tracker.is_file() and tracker.read_text().strip() == "step_4"):
        assert proc.poll() is None and time.time() < deadline, (tmp_path / "killed.log").read_text()[-3000:]
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    base = shared[1] / "base"
    deadline = time.time() + 60
    while processes_mentioning(str(base)) and time.time() < deadline:  # the engine of the killed run
        time.sleep(0.5)
    assert not processes_mentioning(str(base))
    killed_prefix = (run / "shm_prefix").read_text()
    resumed = subprocess.run([sys.executable, "-m", "loongsage.cli", "train", "--resume", str(run)],
                             capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "at step 4 from step_4" in " ".join(resumed.stdout.split())

    steps = [r for r in read_metrics(run) if r["step"] > 0 and "reward/mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(r["staleness/max"] <= 1 for r in steps)
    ledger = read_ledger(run / "prompts.jsonl")
    cursors = sorted(x["cursor"] for x in ledger)
    assert cursors == list(range(len(ledger)))  # every prompt drawn: one fate, none lost, none twice
    trained = [x for x in ledger if x["fate"] == "trained"]
    assert len(trained) * 8 == sum(r["samples/trained"] for r in steps)  # n = 8 samples per prompt
    assert {x["step"] for x in trained} == set(range(1, 9))
    assert not processes_mentioning(str(run))
    deadline = time.time() + 30  # the resumed run's own buffers go as its actors exit, just after it
    while set(os.listdir("/dev/shm")) - shm_before and time.time() < deadline:
        time.sleep(0.5)
    assert not set(os.listdir("/dev/shm")) - shm_before, killed_prefix  # the killed run's removed by the resume
