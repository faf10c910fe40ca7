"""On-policy distillation: each signal against a hand or dense computation, the roles in the loss,
teacher scoring through a real engine (prefill only), the Teacher Manager's memory budget, tokenizer
checks, and exact per-source proportions in every data-parallel shard."""
from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import reference_logprobs, run
from loongsage.algo import distill as D
from loongsage.algo.config import AlgoConfig, DistillConfig, LossConfig
from loongsage.config import ConfigError, load_config
from loongsage.controller.bootstrap import base_policy_dir, teacher_bootstrap_config
from loongsage.controller.sources import stratify
from loongsage.rollout.client import EngineClient, EngineError
from loongsage.rollout.router import Router
from loongsage.sample import Group, Sample, TeacherScores
from loongsage.teachers.config import TeacherConfig
from loongsage.teachers.launch import TeacherError, check_tokenizer
from loongsage.teachers.manager import Teacher, TeacherManager
from loongsage.trainer.batch import collate
from loongsage.trainer.step import TokenScores, micro_batch_loss


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_sampled_token_estimators_by_hand():
    q, p = t([math.log(0.5)]), t([math.log(0.25)])  # student 0.5, teacher 0.25 on the sampled token
    assert D.sampled_token("k1", q, p).item() == pytest.approx(math.log(2))
    assert D.sampled_token("k2", q, p).item() == pytest.approx(0.5 * math.log(2) ** 2)
    assert D.sampled_token("k3", q, p).item() == pytest.approx(0.5 - 1 + math.log(2))  # p/q - 1 - log(p/q)
    with pytest.raises(ValueError, match="sampled-token signal"):
        D.sampled_token("k4", q, p)


def test_sampled_token_estimators_average_to_the_kl():
    """Over samples of q, k1 and k3 are unbiased estimates of KL(q || p)."""
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), -1)
    p = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64), -1)
    kl = (q * (q.log() - p.log())).sum().item()
    for kind in ("k1", "k3"):
        expected = (q * D.sampled_token(kind, q.log(), p.log())).sum().item()
        assert expected == pytest.approx(kl, rel=1e-9)


def test_full_vocabulary_kl_and_jsd_match_a_dense_computation():
    g = torch.Generator().manual_seed(1)
    logits_s, logits_t = torch.randn(3, 5, 40, generator=g), torch.randn(3, 5, 40, generator=g)
    q, p = torch.softmax(logits_s.double(), -1), torch.softmax(logits_t.double(), -1)
    dense_kl = (q * (q.log() - p.log())).sum(-1)
    m = 0.5 * (q + p)
    dense_jsd = 0.5 * (q * (q.log() - m.log())).sum(-1) + 0.5 * (p * (p.log() - m.log())).sum(-1)
    assert torch.allclose(D.support_divergence("full_kl", q.log(), p.log()), dense_kl, atol=1e-12)
    assert torch.allclose(D.support_divergence("full_jsd", q.log(), p.log()), dense_jsd, atol=1e-12)
    dense_fkl = (p * (p.log() - q.log())).sum(-1)
    assert torch.allclose(D.support_divergence("full_fkl", q.log(), p.log()), dense_fkl, atol=1e-12)


def test_top_k_kl_counts_the_rest_of_the_mass_as_one_bucket():
    q = t([0.5, 0.2, 0.3])  # student: two teacher-top tokens, then the rest
    p = t([0.6, 0.3, 0.1])
    got = D.support_divergence("topk_kl", q[:2].log(), p[:2].log()).item()
    assert got == pytest.approx(sum(a * math.log(a / b) for a, b in zip(q.tolist(), p.tolist())))
    fkl = D.support_divergence("topk_fkl", q[:2].log(), p[:2].log()).item()
    assert fkl == pytest.approx(sum(b * math.log(b / a) for a, b in zip(q.tolist(), p.tolist())))
    jsd = D.support_divergence("topk_jsd", q[:2].log(), p[:2].log()).item()
    m = (q + p) / 2
    assert jsd == pytest.approx(0.5 * (q * (q / m).log()).sum().item() + 0.5 * (p * (p / m).log()).sum().item())


def test_mixture_and_advantage_shaping():
    per_teacher = t([[[1.0, 3.0], [2.0, 0.0]]])  # [B=1, T=2, M=2]
    mixed = D.mix(per_teacher, t([[0.25, 0.75]]))
    assert mixed.tolist() == [[2.5, 0.5]]
    assert D.shaped_advantages(t([[1.0, 1.0]]), mixed, 0.5).tolist() == [[-0.25, 0.75]]


def _scored_sample(teacher_lp, top_ids=None, top_lp=None, advantage=1.0, mask=None):
    n = len(teacher_lp)
    s = Sample([1, 2], list(range(3, 3 + n)), mask or [1] * n, [-1.0] * n, [0] * n, advantage=advantage)
    s.teacher["a"] = TeacherScores(teacher_lp, top_ids, top_lp, 1.0)
    return s


def test_gkd_loss_is_the_masked_divergence_and_inserted_tokens_are_not_distilled():
    """g = 1: the loss is the token mean of k3 over trained tokens only (a tool response, mask 0,
    contributes nothing however far the student is from the teacher there)."""
    sample = _scored_sample([-0.5, -3.0, -0.2], mask=[1, 0, 1])
    batch = collate([sample], 0, ["a"])
    lp = torch.full(batch.loss_mask.shape, -1.0, requires_grad=True)
    cfg = LossConfig(distill=DistillConfig(gkd_coef=1.0, gkd_signal="k3"))
    value, metrics = micro_batch_loss(TokenScores(lp), batch, "policy", cfg, denominator=batch.num_tokens)
    k3 = lambda s, tt: math.exp(tt - s) - 1 - (tt - s)
    assert value.item() == pytest.approx((k3(-1.0, -0.5) + k3(-1.0, -0.2)) / 2, rel=1e-6)
    value.backward()
    assert lp.grad[0, 2].item() == 0.0 and lp.grad[0, 1].item() != 0.0  # position 2 holds the masked token
    assert "loss/policy" not in metrics  # pure distillation: no RL term


def test_pg_shaping_changes_the_policy_gradient_by_lambda_times_k1():
    sample = _scored_sample([-0.5, -2.0])
    batch = collate([sample], 0, ["a"])
    lp = torch.full(batch.loss_mask.shape, -1.0, requires_grad=True)
    plain = LossConfig(is_mode="none")
    shaped = LossConfig(is_mode="none", distill=DistillConfig(pg_coef=0.5, pg_signal="k1"))
    grads = []
    for cfg in (plain, shaped):
        x = lp.detach().clone().requires_grad_(True)
        value, _ = micro_batch_loss(TokenScores(x), batch, "policy", cfg, denominator=batch.num_tokens)
        value.backward()
        grads.append(x.grad[0, 1:3].clone())
    # d loss / d lp_t = -A_t / N (ratio 1); shaping: A_t - 0.5 * (lp_t - teacher_t)
    assert torch.allclose(grads[0], torch.tensor([-0.5, -0.5]))
    assert torch.allclose(grads[1], torch.tensor([-(1 - 0.5 * (-1.0 + 0.5)) / 2, -(1 - 0.5 * (-1.0 + 2.0)) / 2]))


def test_invalid_role_combinations_are_config_errors():
    with pytest.raises(ValueError, match="pure distillation has no RL advantage to shape"):
        DistillConfig(pg_coef=0.1, gkd_coef=1.0)
    with pytest.raises(ValueError):
        DistillConfig(pg_coef=0.1, pg_signal="k3")  # not a signed estimator
    with pytest.raises(ValueError):
        DistillConfig(gkd_coef=0.5, gkd_signal="k1")  # zero-mean gradient on-policy
    assert DistillConfig(gkd_coef=1.0, gkd_signal="full_jsd").needs_top == "full"
    assert DistillConfig(pg_coef=1.0, pg_signal="topk_kl").needs_top == "topk"


def test_pure_distillation_mini_batches_need_no_proximal_pass():
    """Its loss has no ratio to the pre-update policy; a mixture with RL (or PG shaping) keeps the pass."""
    def algo(**distill):
        return AlgoConfig(mini_batches=2, loss=LossConfig(distill=DistillConfig(**distill)))
    assert not algo(gkd_coef=1.0).needs_proximal_pass
    assert algo(gkd_coef=0.5).needs_proximal_pass and algo(pg_coef=0.5).needs_proximal_pass
    assert AlgoConfig(mini_batches=2).needs_proximal_pass and not AlgoConfig().needs_proximal_pass
    assert AlgoConfig(recompute_proximal=True, loss=LossConfig(distill=DistillConfig(gkd_coef=1.0))).needs_proximal_pass


def test_every_mini_batch_of_every_rank_must_get_each_source_in_proportion():
    two = ("data_sources=[{name: a, task: {name: arithmetic}, prompts_per_step: 4, sampling: {n: 4}}, "
           "{name: b, task: {name: reverse}, prompts_per_step: 2, sampling: {n: 4}}]")
    load_config(None, [two, "algo.mini_batches=2", "trainer.world_size=2"])  # 16 and 8 samples over 4 parts
    with pytest.raises(ConfigError, match="16 samples cannot be split evenly over 3 parts .data-parallel ranks x "
                                          "algo.mini_batches"):
        load_config(None, [two, "algo.mini_batches=3"])


def test_a_teacher_bootstrap_rolls_out_like_the_source_it_serves():
    """An agent teacher's dev rollouts need the room its source gives tool calls (a short default
    truncates every call and the bootstrap never sees a correct answer)."""
    cfg = load_config("recipes/multi_teacher_opd.yaml")
    calc = next(s for s in cfg.data_sources if s.name == "calc")
    derived = teacher_bootstrap_config(cfg, next(t for t in cfg.teachers if t.name == "calc_teacher"))
    assert derived.sampling == calc.sampling and derived.agent.kind == "whitebox"
    assert [s.task.params["tool_demo_rate"] for s in derived.sources()] == [1.0]  # its own task, not the source's
    assert base_policy_dir(derived) != base_policy_dir(cfg)


def test_stratified_order_gives_every_shard_each_source_in_proportion():
    samples = [Sample([1], [2] * (1 + i % 5), [1] * (1 + i % 5), [0.0] * (1 + i % 5), [0] * (1 + i % 5), source="a")
               for i in range(8)]
    samples += [Sample([1], [2] * (1 + i), [1] * (1 + i), [0.0] * (1 + i), [0] * (1 + i), source="b") for i in range(4)]
    for parts in (1, 2, 4):
        ordered = stratify(samples, parts)
        assert sorted(map(id, ordered)) == sorted(map(id, samples))
        size = len(samples) // parts
        for k in range(parts):
            shard = ordered[k * size:(k + 1) * size]
            assert sum(s.source == "a" for s in shard) == 8 // parts
            assert sum(s.source == "b" for s in shard) == 4 // parts
    tokens = [sum(len(s.response_ids) for s in ordered[k * 3:(k + 1) * 3]) for k in range(4)]
    assert max(tokens) - min(tokens) <= 4  # lengths spread over the shards


# ---- teachers on real engines -----------------------------------------------------------------------
def test_teacher_scores_equal_a_full_forward_of_the_teacher(engine_b, tiny_model_b):
    """A prefill of the student's exact ids returns, per response token, the teacher's logprob of it
    and its top-k, as transformers computes them on the same sequence. A group is one batched request
    (per-sample `logprob_start_len`): samples with prompts of different lengths each get their own."""
    cases = [([10, 11, 12, 13], [20, 21, 22]), ([14, 15], [23, 24, 25, 26]), ([16, 17, 18, 19, 20, 21], [27])]
    teacher = Teacher(TeacherConfig(name="b", model=tiny_model_b), Router([engine_b.url]), 1)
    mgr = TeacherManager([teacher], None, top_k=5)

    async def go():
        await mgr.start()
        group = [Sample(p, r, [1] * len(r), [0.0] * len(r), [0] * len(r)) for p, r in cases]
        await mgr.score_group(Group(group, [0.0] * len(group)), {"b": 1.0})
        await mgr.close()
        return [s.teacher["b"] for s in group]
    for (prompt, response), scores in zip(cases, run(go())):
        ref = reference_logprobs(tiny_model_b, prompt + response)
        want = [ref[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(response)]
        assert scores.logprobs == pytest.approx(want, abs=1e-4)
        top = ref[len(prompt) - 1: len(prompt) - 1 + len(response)].topk(5, dim=-1)
        assert scores.top_ids == top.indices.tolist()
        assert [[round(v, 4) for v in row] for row in scores.top_logprobs] == \
            [[round(v, 4) for v in row] for row in top.values.tolist()]


class CountingRouter(Router):
    """A real router that counts its batched scoring requests."""
    calls: list

    async def generate_batch(self, batch, sampling_params, rid=None, **kw):
        self.calls.append(len(batch))
        return await super().generate_batch(batch, sampling_params, rid, **kw)


def test_groups_queued_together_are_one_request_and_a_bad_group_fails_alone(engine_b, tiny_model_b):
    """Single-sample groups (n = 1) that complete together are scored together, in requests of at
    most BATCH_SAMPLES (64) samples, not one request each; a group the engine refuses (longer than
    the teacher's 256-token context) fails alone: the others in its request are scored all the same."""
    router = CountingRouter([engine_b.url])
    router.calls = []
    mgr = TeacherManager([Teacher(TeacherConfig(name="b", model=tiny_model_b), router, 1)], None, top_k=2)
    good = [Sample([10 + i % 40, 11], [20, 21 + i % 50], [1, 1], [0.0] * 2, [0] * 2) for i in range(74)]
    bad = Sample([10] * 250, [20] * 10, [1] * 10, [0.0] * 10, [0] * 10)

    async def go():
        await mgr.start()
        try:
            first = await asyncio.gather(*[mgr.score_group(Group([s], [0.0]), {"b": 1.0}) for s in good[:70]])
            calls = list(router.calls)
            mixed = await asyncio.gather(*[mgr.score_group(Group([s], [0.0]), {"b": 1.0}) for s in [*good[70:], bad]],
                                         return_exceptions=True)
            return first, calls, mixed
        finally:
            await mgr.close()
    first, calls, mixed = run(go())
    assert calls == [64, 6]  # seventy groups, two requests
    assert all(r is None for r in mixed[:-1]) and isinstance(mixed[-1], EngineError)
    assert "context" in str(mixed[-1])
    for s in good:
        ref = reference_logprobs(tiny_model_b, s.prompt_ids + s.response_ids)
        want = [ref[len(s.prompt_ids) - 1 + i, tok].item() for i, tok in enumerate(s.response_ids)]
        assert s.teacher["b"].logprobs == pytest.approx(want, abs=1e-4)


def test_tokens_after_the_last_trained_one_are_not_sent_to_the_teacher(engine_b, tiny_model_b):
    """An agent's last tool result follows its last model turn: never distilled, and it may take the
    sequence past the agent's token limit and the teacher's context (256 here). Only the tokens up to
    the last trained one are scored; the rest get placeholders of the same shape (loss mask 0)."""
    prompt, trained, inserted = [10, 11, 12, 13], [20, 21, 22, 23], [30] * 300
    response = trained[:2] + [31, 32] + trained[2:] + inserted
    mask = [1, 1, 0, 0, 1, 1] + [0] * len(inserted)
    teacher = Teacher(TeacherConfig(name="b", model=tiny_model_b), Router([engine_b.url]), 1)
    mgr = TeacherManager([teacher], None, top_k=4)

    async def go():
        await mgr.start()
        s = Sample(prompt, response, mask, [0.0] * len(response), [0] * len(response))
        await mgr.score_group(Group([s], [0.0]), {"b": 1.0})
        await mgr.close()
        return s.teacher["b"]
    scores = run(go())
    assert len(scores.logprobs) == len(scores.top_ids) == len(scores.top_logprobs) == len(response)
    ref = reference_logprobs(tiny_model_b, prompt + response[:6])
    want = [ref[len(prompt) - 1 + i, tok].item() for i, tok in enumerate(response[:6])]
    assert scores.logprobs[:6] == pytest.approx(want, abs=1e-4)
    assert all(row == scores.top_ids[5] for row in scores.top_ids[6:])


async def _resume_all(*urls: str) -> None:
    """The session's shared engines go back resident whatever a test left them as (later tests use them)."""
    for url in urls:
        client = EngineClient(url)
        await client.resume_memory()
        await client.aclose()


def test_a_released_teacher_is_resumed_on_demand_and_scores_identically(engine, engine_b, tiny_model,
                                                                          tiny_model_b):
    """Two teachers, a budget of one: scoring alternates between them, each swap releases the idle
    one first (peak resident bytes never above one teacher), and a released-then-resumed teacher
    gives exactly the scores it gave before."""
    size = 10
    ta = Teacher(TeacherConfig(name="a", model=tiny_model), Router([engine.url]), size)
    tb = Teacher(TeacherConfig(name="b", model=tiny_model_b), Router([engine_b.url]), size)
    mgr = TeacherManager([ta, tb], budget_bytes=size, top_k=3)

    async def go():
        try:
            await mgr.start()
            assert ta.resident and not tb.resident
            rounds = []
            for _ in range(2):
                for name in ("a", "b"):
                    s = Sample([10, 11, 12], [30, 31], [1, 1], [0.0, 0.0], [0, 0])
                    await mgr.score_group(Group([s], [0.0]), {name: 1.0})
                    rounds.append((name, s.teacher[name]))
            info = [await EngineClient(u).model_info() for u in (engine.url, engine_b.url)]
            return rounds, info, mgr.metrics()
        finally:
            await mgr.close()
            await _resume_all(engine.url, engine_b.url)
    rounds, info, metrics = run(go())
    by = {}
    for name, scores in rounds:
        by.setdefault(name, []).append(scores)
    for name, (first, again) in by.items():
        # the same weights; the first pass may reuse K/V other tests left in the engine's prefix cache
        # (a resumed engine starts with an empty one), which moves logprobs by ~1e-6, not more
        assert first.logprobs == pytest.approx(again.logprobs, abs=1e-5) and first.top_ids == again.top_ids, name
        for a, b in zip(first.top_logprobs, again.top_logprobs):
            assert a == pytest.approx(b, abs=1e-5), name
    assert metrics["teacher/swaps"] >= 3 and metrics["teacher/peak_resident_bytes"] <= size
    assert sum(not i["memory_released"] for i in info) == 1  # one of the two engines holds its weights


def test_concurrent_work_for_two_teachers_under_a_budget_of_one_completes(engine, engine_b, tiny_model,
                                                                          tiny_model_b):
    """Groups finish in any order in the async pipeline: interleaved scoring for two teachers that
    cannot be resident together all completes, batched per teacher: jobs that arrive while the
    resident teacher is busy cost one swap per teacher change, not one per job."""
    ta = Teacher(TeacherConfig(name="a", model=tiny_model), Router([engine.url]), 10)
    tb = Teacher(TeacherConfig(name="b", model=tiny_model_b), Router([engine_b.url]), 10)
    mgr = TeacherManager([ta, tb], budget_bytes=10)

    async def go():
        try:
            await mgr.start()
            first = [Sample([10, 11, 12], [30 + (j % 40) for j in range(96)], [1] * 96, [0.0] * 96, [0] * 96)
                     for _ in range(16)]  # a long group keeps teacher a busy while the rest arrive
            samples = [Sample([10, 11, 12], [30 + i, 31], [1, 1], [0.0, 0.0], [0, 0]) for i in range(1, 12)]
            jobs = [asyncio.create_task(mgr.score_group(Group(first, [0.0] * 16), {"a": 1.0}))]
            await asyncio.sleep(0)
            for i, s in enumerate(samples, start=1):  # b, a, b, a, ... arriving while a is scoring
                jobs.append(asyncio.create_task(mgr.score_group(Group([s], [0.0]), {"ab"[i % 2]: 1.0})))
                await asyncio.sleep(0)
            busy_when_all_queued = ta.inflight > 0
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)
            return first + samples, busy_when_all_queued, mgr.metrics()["teacher/swaps"]
        finally:
            await mgr.close()
            await _resume_all(engine.url, engine_b.url)
    samples, busy_when_all_queued, swaps = run(go())
    assert busy_when_all_queued, "the interleaved jobs must arrive while teacher a is still scoring"
    assert all(len(s.teacher) == 1 for s in samples)
    assert swaps == 2  # b swapped in once for all its jobs, then a once for the rest of its jobs


def test_teacher_memory_benchmark_holds_one_teacher_under_a_budget_of_one(tmp_path):
    """benchmarks/teacher_memory.py, small: three teachers served in turn under a budget of one
    (released weights go to each engine's temporary folder: none is left behind)."""
    out = subprocess.run([sys.executable, "benchmarks/teacher_memory.py", "--teachers", "3", "--groups", "12",
                          "--in-flight", "4", "--hidden", "64"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TMPDIR=str(tmp_path)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert not list(tmp_path.iterdir())
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["peak_over_one"] <= 1.3 and result["swaps"] >= 2, result
    assert result["samples_per_s_budget"] > 0 and result["samples_per_s_all_resident"] > 0


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, tiny_model):
    from loongsage.models.config import TinyModelSpec
    from loongsage.models.factory import build_tiny_model

    other = build_tiny_model(tmp_path / "other", TinyModelSpec(max_position_embeddings=40))
    vocab = (other / "tokenizer.json").read_text()
    (other / "tokenizer.json").write_text(vocab.replace('"a":', '"@@":', 1))
    with pytest.raises(TeacherError, match="different tokenizer than the student"):
        check_tokenizer(tiny_model, str(other), "other")
    check_tokenizer(tiny_model, tiny_model, "same")


def test_a_teacher_that_follows_the_student_receives_its_weights_every_k_steps(ray_session, tiny_model):
    """Self-distillation: the teacher is a TransferMesh receiver of the trainer; on every K-th version
    it serves exactly the trainer's weights (checksum), in between it keeps the last ones."""
    from helpers import policy_batch
    from loongsage.teachers.launch import start_teachers, stop_teachers
    from loongsage.trainer.config import TrainerConfig
    from loongsage.trainer.group import TrainerGroup

    cfg = load_config(None, [f"teachers=[{{name: me, model: {tiny_model}, follow_student_every: 2, "
                             "engine: {context_length: 64}}]", "algo.loss.distill.gkd_coef=0.5"])
    trainers = TrainerGroup(TrainerConfig(lr=1e-2), tiny_model)

    async def go():
        mgr = await start_teachers(cfg, [tiny_model], tiny_model, "loongsage-", trainers)
        client = mgr.teachers["me"].router.clients[0]
        try:
            seen = []
            for version in (1, 2, 3):
                await trainers.train_step(policy_batch(seed=version), "policy", LossConfig())
                out = await mgr.follow_student(version)
                seen.append((version, (await client.model_info())["weight_version"], out))
            names = [m[0] for m in trainers.weight_meta()]
            want = await trainers.rank0.transfer.remote("verify", "checksum", names, "float32")
            got = (await client.weights_checksum())["checksum"]
            return seen, str(want), got
        finally:
            await stop_teachers(mgr)
    try:
        seen, want, got = run(go())
    finally:
        trainers.shutdown()
    assert [v for _, v, _ in seen] == ["0", "2", "2"]  # only version 2 is due (K = 2)
    assert seen[1][2]["teacher/follow_sync_s"] > 0 and seen[0][2]["teacher/follow_sync_s"] == 0.0
    assert want != got  # version 3 trained further; the teacher holds version 2
