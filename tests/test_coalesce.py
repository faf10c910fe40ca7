"""Request coalescing (rollout/coalesce.py) against a real engine: calls made together go out as one
batched request and get what requests of their own would have; an abort still reaches one caller's
sequences only; a prompt the engine refuses fails alone."""
from __future__ import annotations

import asyncio

import pytest

from helpers import run
from loongsage.rollout.client import EngineError
from loongsage.rollout.router import Router


class SpyRouter(Router):
    """A real router that counts the HTTP generate requests it sends."""

    def __init__(self, urls, **kw):
        super().__init__(urls, **kw)
        self.sent = []

    async def _send(self, prompts, params, callers, payload_rid, **kw):
        self.sent.append(len(callers))
        return await super()._send(prompts, params, callers, payload_rid, **kw)


def _prompts(k: int) -> list[list[int]]:
    return [[10 + i % 50, 11 + i % 7, 12 + i % 3] for i in range(k)]


def test_calls_made_together_are_one_request_with_the_outputs_of_their_own(engine):
    """20 groups of n = 2, each with its own sampling seed: one request (up to 16 prompts each: two),
    and every group's samples are token for token the ones a request of its own gets."""
    params = {"temperature": 1.0, "max_new_tokens": 6, "n": 2}

    async def go(coalesce: int):
        router = SpyRouter([engine.url], coalesce_prompts=coalesce)
        try:
            outs = await asyncio.gather(*[router.generate(p, {**params, "sampling_seed": 100 + i}, session=f"g{i}",
                                                          return_logprob=True)
                                          for i, p in enumerate(_prompts(20))])
            return router.sent, [[(o.output_ids, o.output_logprobs) for o in group] for group in outs]
        finally:
            await router.aclose()

    sent, coalesced = run(go(16))
    alone_sent, alone = run(go(0))
    assert sent == [16, 4] and alone_sent == [1] * 20
    assert [[ids for ids, _ in g] for g in coalesced] == [[ids for ids, _ in g] for g in alone]
    for g, h in zip(coalesced, alone):
        for (_, a), (_, b) in zip(g, h):
            assert a == pytest.approx(b, abs=1e-4)
    assert len({tuple(g[0][0]) for g in coalesced}) > 1  # the seeds differ, so do the samples


def test_an_abort_in_a_coalesced_batch_reaches_its_caller_only(engine):
    long = {"temperature": 1.0, "max_new_tokens": 120, "ignore_eos": True}

    async def go():
        router = Router([engine.url], coalesce_prompts=8, abort_retries=0)
        try:
            calls = [asyncio.create_task(router.generate(p, long, session=f"g{i}")) for i, p in enumerate(_prompts(4))]
            while len(router.inflight) < 4:
                await asyncio.sleep(0.01)
            aborted = await router.abort_where(lambda s: s == "g1")
            return aborted, await asyncio.gather(*calls)
        finally:
            await router.aclose()

    aborted, outs = run(go())
    assert aborted == 1
    assert [o[0].finish_type for o in outs] == ["length", "abort", "length", "length"]
    assert len(outs[1][0].output_ids) < 120 and all(len(outs[i][0].output_ids) == 120 for i in (0, 2, 3))


def test_a_prompt_the_engine_refuses_fails_alone(engine):
    params = {"temperature": 0.0, "max_new_tokens": 4}
    prompts = _prompts(5)
    prompts[2] = [10, 10**6]  # outside the vocabulary: the engine refuses the whole batch (HTTP 400)

    async def go():
        router = SpyRouter([engine.url], coalesce_prompts=8)
        try:
            outs = await asyncio.gather(*[router.generate(p, params) for p in prompts], return_exceptions=True)
            return router.sent, outs
        finally:
            await router.aclose()

    sent, outs = run(go())
    assert sent == [5, 1, 1, 1, 1, 1]  # the batch, then a request per prompt
    assert isinstance(outs[2], EngineError) and outs[2].status == 400 and "vocabulary" in str(outs[2])
    assert all(len(o[0].output_ids) == 4 for i, o in enumerate(outs) if i != 2)
