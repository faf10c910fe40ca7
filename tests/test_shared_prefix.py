"""Shared-prefix forward (trainer/shared_prefix.py): the same scores and gradients as one plain
forward of the micro-batch, with the shared prefix run once per group."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from loongsage.algo.config import LossConfig
from loongsage.sample import Sample
from loongsage.trainer.batch import collate
from loongsage.trainer.config import TrainerConfig
from loongsage.trainer.group import TrainerGroup
from loongsage.trainer.shared_prefix import prefix_groups, shared_prefix_scores
from loongsage.trainer.step import score_tokens


def agent_like_batch(seed: int = 0):
    """Two prompt families sharing a 40-token system prompt (one with a 6-token longer common part and
    responses that begin alike), rows of other lengths, one row unlike any other, and per-token
    temperatures."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 120) for _ in range(40)]
    samples = []
    for family in range(2):
        question = [rng.randrange(3, 120) for _ in range(6)]
        for _ in range(3):
            prompt = system + (question if family == 0 else [rng.randrange(3, 120) for _ in range(5)])
            n = rng.randrange(3, 12)
            resp = [rng.randrange(3, 120) for _ in range(n)]
            if family == 0:
                resp[0] = 9  # the family's responses begin alike (a tool call's first token)
            samples.append(Sample(prompt, resp, [1] * n, [-1.0] * n, [0] * n, temperatures=[0.7] * n))
    alone = [rng.randrange(3, 120) for _ in range(30)]
    samples.append(Sample(alone, [5, 6, 7], [1, 1, 1], [-1.0] * 3, [0] * 3, temperatures=[1.0] * 3))
    batch = collate(samples, pad_id=0)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(seed))
    return batch


def grpo_like_batch(seed: int = 1):
    """GRPO groups: prompts of 5 to 9 tokens, each answered 4 times with 1 to 6 tokens, the groups
    shuffled together, per-token temperatures and 2 teachers' top-3 ids at every column."""
    rng = random.Random(seed)
    samples = []
    for _ in range(5):
        prompt = [rng.randrange(3, 120) for _ in range(rng.randrange(5, 10))]
        for _ in range(4):
            n = rng.randrange(1, 7)
            samples.append(Sample(prompt, [rng.randrange(3, 120) for _ in range(n)], [1] * n, [-1.0] * n, [0] * n,
                                  temperatures=[0.8] * n))
    rng.shuffle(samples)
    batch = collate(samples, pad_id=0)
    batch.teacher_top_ids = torch.randint(0, 120, (*batch.loss_mask.shape, 2, 3),
                                          generator=torch.Generator().manual_seed(seed))
    return batch


def plain_scores(model, mb):
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
    return score_tokens(out.logits[:, :-1], mb.input_ids[:, 1:], True, mb.teacher_top_ids, mb.temperatures)


def test_groups_share_the_system_prompt_and_stop_before_the_first_trained_token():
    mb = agent_like_batch()
    groups = prefix_groups(mb, 16)
    shared = [g for g in groups if g.prefix]
    assert [len(g.rows) for g in shared] == [6] and shared[0].prefix == 40  # the families differ after it
    assert groups[-1].rows == [6] and groups[-1].prefix == 0  # the row unlike any other runs plainly
    same_question = prefix_groups(mb.select([0, 1, 2]), 16)
    first_trained = int((mb.loss_mask[:3].sum(0) > 0).nonzero()[0])
    assert same_question[0].prefix == first_trained + 1 == 46  # the whole prompt, not into the responses
    assert all(g.prefix == 0 for g in prefix_groups(mb, 64))  # nothing shares 64 tokens


def test_grpo_groups_share_their_whole_prompts_whatever_their_lengths():
    mb = grpo_like_batch()
    shared = [g for g in prefix_groups(mb, 4) if g.prefix]
    assert sorted(len(g.rows) for g in shared) == [4] * 5
    lengths = mb.attention_mask.sum(dim=1) - (mb.loss_mask > 0).sum(dim=1)  # each row's prompt
    assert all(g.prefix == int(lengths[g.rows[0]]) for g in shared)
    assert len({g.prefix for g in shared}) > 1  # heads and tails of several lengths in one call each


@pytest.mark.parametrize("make_batch, min_prefix", [(agent_like_batch, 16), (grpo_like_batch, 4)])
def test_shared_prefix_scores_and_gradients_equal_the_plain_forward(tiny_model, make_batch, min_prefix):
    mb = make_batch()
    mask = mb.loss_mask
    results = []
    for shared in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)  # a copy of its own
        model.train()
        s = shared_prefix_scores(model, mb, "cpu", True, True, min_prefix) if shared else plain_scores(model, mb)
        assert s is not None
        loss = -(s.logprobs * mask).sum() + 0.1 * (s.entropy * mask).sum()
        if s.at_teacher_top is not None:
            loss = loss - 0.1 * (s.at_teacher_top.sum((2, 3)) * mask).sum()
        loss.backward()
        results.append((s, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (plain, g_plain), (grouped, g_grouped) = results
    assert torch.allclose(plain.logprobs * mask, grouped.logprobs * mask, atol=1e-5)
    assert torch.allclose(plain.entropy * mask, grouped.entropy * mask, atol=1e-5)
    if mb.teacher_top_ids is not None:
        m = mask[:, :, None, None]
        assert torch.allclose(plain.at_teacher_top * m, grouped.at_teacher_top * m, atol=1e-5)
    worst = max(float((g_plain[n] - g_grouped[n]).abs().max() / g_plain[n].abs().max().clamp(min=1e-8)) for n in g_plain)
    assert worst < 1e-4, worst
    assert float(g_grouped["model.embed_tokens.weight"].abs().sum()) > 0


async def _policy_step(group: TrainerGroup, batch, loss_cfg: LossConfig):
    batch.proximal_logprobs, _ = await group.compute_logprobs(batch)
    return batch.proximal_logprobs, await group.train_step(batch, "policy", loss_cfg)


def test_a_trainer_rank_trains_the_same_with_and_without_shared_prefixes(ray_session, tiny_model):
    loss_cfg = LossConfig(is_mode="none", aggregation="token_mean")
    out = {}
    for n in (0, 16):
        group = TrainerGroup(TrainerConfig(lr=1e-2, micro_batch_size=4, shared_prefix=n), tiny_model)
        try:
            out[n] = asyncio.run(_policy_step(group, agent_like_batch(), loss_cfg))
        finally:
            group.shutdown()
    (lp0, m0), (lp1, m1) = out[0], out[16]
    mask = agent_like_batch().loss_mask
    assert torch.allclose(lp0 * mask, lp1 * mask, atol=1e-5)
    assert m1["loss/policy"] == pytest.approx(m0["loss/policy"], abs=1e-5)
    assert m1["train/grad_norm"] == pytest.approx(m0["train/grad_norm"], rel=1e-4)
    assert m0["train/shared_prefix_frac"] == 0 and m1["train/shared_prefix_frac"] > 0.4  # 5 rows x 40 of 7 x ~50
