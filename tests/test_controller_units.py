"""Pure pieces of the controller path: collate/shards, router choice, LR schedule, sampler, metrics."""
from __future__ import annotations

import asyncio

import pytest

from loongsage.controller.sampler import PromptSampler
from loongsage.metrics import MetricsWriter, read_metrics
from loongsage.rollout.router import Router
from loongsage.sample import Sample
from loongsage.tasks.base import TaskRow
from loongsage.trainer.batch import collate
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.step import lr_factor


def test_collate_aligns_response_tokens_to_next_token_columns():
    s1 = Sample([5, 6, 7], [8, 9], [1, 0], [-0.5, -0.7], [3, 3], advantage=2.0)
    s2 = Sample([5], [4, 3, 2], [1, 1, 1], [-1.0, -2.0, -3.0], [2, 2, 3], advantage=-1.0)
    b = collate([s1, s2], pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 4, 3, 2, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # column t scores token t+1: s1's response starts at position 3 -> column 2
    assert b.loss_mask.tolist() == [[0, 0, 1, 0], [1, 1, 1, 0]]
    assert b.behavior_logprobs[0, 2].item() == -0.5 and b.behavior_logprobs[1, 2].item() == -3.0
    assert b.advantages[0].tolist() == [0, 0, 2.0, 2.0] and b.advantages[1, :3].tolist() == [-1.0] * 3
    assert s2.min_version == 2 and s1.min_version == 3
    shards = b.shards(3)
    assert [s.size for s in shards] == [1, 1, 1] and shards[2].loss_mask.sum() == 0  # padded, masked
    with pytest.raises(ValueError, match="must align"):
        Sample([1], [2, 3], [1], [0.0, 0.0], [0, 0])


def test_micro_batches_sort_rows_by_length_and_trim_each_to_its_longest_row():
    lengths = [9, 3, 7, 2, 5]  # prompt 1 + response (length - 1)
    samples = [Sample([1], list(range(10, 9 + n)), [1] * (n - 1), [-0.1 * n] * (n - 1), [0] * (n - 1), advantage=n)
               for n in lengths]
    b = collate(samples, pad_id=0)
    mbs = b.micro_batches(2)
    assert [idx for idx, _ in mbs] == [[3, 1], [4, 2], [0]]  # shortest first
    assert [mb.input_ids.shape[1] for _, mb in mbs] == [3, 7, 9]
    assert [mb.loss_mask.shape[1] for _, mb in mbs] == [2, 6, 8]
    for idx, mb in mbs:  # nothing but padding was cut: the trimmed rows hold every token of their samples
        for row, i in enumerate(idx):
            assert mb.input_ids[row].tolist()[: lengths[i]] == [1] + samples[i].response_ids
            assert mb.loss_mask[row].sum() == lengths[i] - 1 == b.loss_mask[i].sum()
            assert mb.advantages[row, : lengths[i] - 1].tolist() == [float(lengths[i])] * (lengths[i] - 1)


def test_router_least_outstanding_and_sticky_sessions():
    r = Router(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    r.outstanding = [3, 1, 2]
    assert r.pick() == 1
    assert r.pick("conv-a") == 1
    r.outstanding = [0, 9, 9]
    assert r.pick("conv-a") == 1  # sticks to the engine holding its prefix
    assert r.pick("conv-b") == 0
    with pytest.raises(ValueError):
        Router([])


def test_a_call_on_each_engine_marks_down_those_that_fail_it_and_raises_a_wrong_call():
    """What colocation's hand-overs rely on: a dead engine does not fail the hand-over of the others."""
    from loongsage.rollout.client import EngineError

    r = Router(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    reported, seen = [], []
    # the supervisor checks (and so replaces) only an engine it still finds up when told of the failure
    r.on_engine_failure = lambda idx, exc: reported.append((idx, r.up[idx]))

    async def call(client):
        seen.append(r.clients.index(client))
        if client is r.clients[0]:
            raise ConnectionError("engine went away")

    asyncio.run(r.on_each_up(call))
    assert seen == [0, 1] and r.up == [False, True] and reported == [(0, True)]
    asyncio.run(r.on_each_up(call))
    assert seen == [0, 1, 1]  # a down engine is skipped

    async def wrong(client):
        raise EngineError(400, "unknown tag", "http://127.0.0.1:2")
    with pytest.raises(EngineError, match="unknown tag"):  # the call's own fault is not the engine's
        asyncio.run(r.on_each_up(wrong))
    assert r.up == [False, True]


def test_lr_schedules():
    warm = TrainerConfig(warmup_steps=4)
    assert [lr_factor(s, warm) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = TrainerConfig(lr_schedule="cosine", total_steps=10)
    assert lr_factor(0, cos) == 1.0 and lr_factor(5, cos) == pytest.approx(0.5) and lr_factor(10, cos) == pytest.approx(0.0)
    lin = TrainerConfig(lr_schedule="linear", total_steps=4, warmup_steps=0)
    assert lr_factor(2, lin) == 0.5
    wsd = TrainerConfig(lr_schedule="linear", total_steps=10, warmup_steps=2, decay_steps=4)
    assert [lr_factor(s, wsd) for s in range(11)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="decay_steps"):
        TrainerConfig(lr_schedule="linear", total_steps=10, warmup_steps=2, decay_steps=9)
    with pytest.raises(ValueError, match="decay_steps"):
        TrainerConfig(decay_steps=3)


def test_sft_bootstraps_keep_their_own_constant_schedule_whatever_the_runs_decay():
    from loongsage.config import load_config
    from loongsage.controller.sft import sft_trainer

    cfg = load_config("recipes/multi_teacher_opd.yaml")
    assert cfg.trainer.decay_steps == 120
    for sft in [cfg.bootstrap.sft] + [t.bootstrap.sft for t in cfg.teachers]:
        t = sft_trainer(cfg.trainer, sft)
        assert (t.lr_schedule, t.total_steps, t.decay_steps, t.lr) == ("constant", None, None, sft.lr)
        assert lr_factor(10_000, t) == 1.0


def test_an_sft_with_its_own_threads_is_not_pinned_to_the_runs_trainer_core():
    """The count recipe pins its trainer to core 0 (the engine has core 1) for its async run; its
    bootstrap asks for 2 threads, which one pinned core would only make contend."""
    from loongsage.config import load_config
    from loongsage.controller.sft import sft_trainer

    cfg = load_config("recipes/count_grpo.yaml")
    assert cfg.trainer.cpu_affinity == [0] and cfg.trainer.threads == 1
    t = sft_trainer(cfg.trainer, cfg.bootstrap.sft)
    assert (t.threads, t.cpu_affinity) == (2, None)
    t = sft_trainer(cfg.trainer, cfg.bootstrap.sft.model_copy(update={"threads": None}))
    assert (t.threads, t.cpu_affinity) == (1, [0])  # unset: the run's trainer as it is


def test_sampler_covers_every_row_each_epoch():
    rows = [TaskRow(prompt=str(i), answer="x") for i in range(5)]
    s = PromptSampler(rows, seed=1)
    first = s.take(5)
    assert sorted(r.prompt for r in first) == [str(i) for i in range(5)]
    assert len(s.take(7)) == 7 and s.epoch == 3


def test_metrics_jsonl_and_tensorboard(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write({"step": 0, "eval/accuracy": 0.5})
    w.write({"step": 1, "reward/mean": float("nan"), "note": "x"})
    w.close()
    recs = read_metrics(tmp_path)
    assert recs[0]["eval/accuracy"] == 0.5 and recs[1]["reward/mean"] is None
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    with pytest.raises(FileNotFoundError, match="no metrics"):
        read_metrics(tmp_path / "nothing")


def test_a_batch_without_learning_signal_is_not_trained():
    """All-zero advantages (every group's rewards equal) give a zero gradient, but Adam's momentum
    would still move the weights: such a batch must be skipped unless a KL or entropy term acts."""
    from loongsage.algo.config import LossConfig
    from loongsage.controller.train import has_learning_signal

    flat = [Sample([1], [2, 3], [1, 1], [-0.1, -0.2], [0, 0], advantage=0.0) for _ in range(4)]
    assert not has_learning_signal(flat, LossConfig())
    assert has_learning_signal(flat, LossConfig(kl_coef=0.01))
    assert has_learning_signal(flat, LossConfig(entropy_coef=0.01))
    flat[2].advantage = -0.35
    assert has_learning_signal(flat, LossConfig())


def test_a_token_is_as_old_as_the_oldest_policy_that_shaped_its_prefix():
    """A request that lived through a weight update keeps the older version's KV cache: its newer
    tokens count as off-policy by the older lag (inserted tokens, version -1, inherit it)."""
    from loongsage.trainer.batch import version_lags

    assert version_lags([3, 3, 4, -1, 5], trained_version=5) == [2, 2, 2, 2, 2]
    assert version_lags([5, 5], trained_version=5) == [0, 0]
    assert version_lags([-1, 4, 5], trained_version=5) == [0, 1, 1]


def test_a_weight_update_that_fails_ends_the_wait_for_the_next_batch():
    """In a synchronous run the next batch waits for that update's version: without this the run
    would wait forever on a failed update (its error unseen in a task nobody awaited yet)."""
    import asyncio

    from loongsage.controller.train import _batch_unless_update_fails

    async def go():
        upcoming = asyncio.create_task(asyncio.sleep(3600))

        async def update():
            raise RuntimeError("flip failed")

        pending = ({}, asyncio.create_task(update()))
        with pytest.raises(RuntimeError, match="flip failed"):
            await asyncio.wait_for(_batch_unless_update_fails(upcoming, pending), 5)
        upcoming.cancel()
        done = asyncio.create_task(asyncio.sleep(0, result="batch"))
        ok = ({}, asyncio.create_task(asyncio.sleep(0.01)))
        assert await _batch_unless_update_fails(done, ok) == "batch"

    asyncio.run(go())


def test_runs_that_differ_only_in_agent_timeout_or_output_cap_share_one_base_policy():
    """The bootstrap cache key holds what shapes the base policy: an agent's timeout or output cap do
    not (a fault test with a 15 s timeout built the calculator bootstrap a second time, ~5 minutes of
    CI), its turns and tokens do (the dev rollouts that stop the SFT)."""
    from loongsage.config import load_config
    from loongsage.controller.bootstrap import base_policy_dir

    base = ["bootstrap.cache_dir=/cache"]
    key = base_policy_dir(load_config("recipes/calc_agent_blackbox.yaml", base))
    assert base_policy_dir(load_config("recipes/calc_agent_whitebox.yaml", base)) == key
    same = ["agent.limits.timeout_s=15", "agent.limits.max_output_bytes=4096"]
    assert base_policy_dir(load_config("recipes/calc_agent_blackbox.yaml", base + same)) == key
    for other in ("agent.limits.max_turns=2", "agent.limits.max_tokens=400"):
        assert base_policy_dir(load_config("recipes/calc_agent_blackbox.yaml", base + [other])) != key


def test_closing_a_runtime_runs_every_step_when_one_fails(tmp_path):
    """A dead trainer fails the TransferMesh's close: the engines must still stop and the run's
    temporary weights folder go, and the failure still reaches the caller."""
    from loongsage.controller.runtime import Runtime

    done: list[str] = []

    class Part:
        def __init__(self, name: str, fail: bool = False):
            self.name, self.fail = name, fail

        async def aclose(self):
            done.append(self.name)
            if self.fail:
                raise RuntimeError(f"{self.name} failed")

        def shutdown(self):
            done.append(self.name)

    weights = tmp_path / "loongsage-weights-x"
    weights.mkdir()
    rt = Runtime(trainers=Part("trainers"), engines=Part("engines"), router=Part("router"),
                 sync=Part("sync", fail=True), ray_started=False, reference=Part("reference"),
                 temp_weights_dir=str(weights), teacher_engines=[Part("teacher")])
    with pytest.raises(RuntimeError, match="sync failed"):
        asyncio.run(rt.close())
    assert done == ["router", "sync", "teacher", "engines", "trainers", "reference"]
    assert not weights.exists()
