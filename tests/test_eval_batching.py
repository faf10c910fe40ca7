"""Held-out evaluation of a single-turn task sends its rows in batched requests of EVAL_BATCH, not one
request per row, and scores exactly what row-by-row greedy requests would."""
from __future__ import annotations

import asyncio
import dataclasses

from transformers import AutoTokenizer

from helpers import run
from loongsage.agentflow.config import AgentConfig
from loongsage.agentflow.rollouts import make_rollout
from loongsage.rollout.router import Router
from loongsage.rollout.single_turn import EVAL_BATCH, RolloutSetup
from loongsage.tasks.base import get_task
from loongsage.tasks.prepare import prompt_ids


class SpyRouter(Router):
    """A real router that records the requests it is asked for."""

    def __init__(self, urls):
        super().__init__(urls)
        self.batches, self.singles = [], 0

    async def generate_batch(self, batch, sampling_params, rid=None, **kw):
        self.batches.append(len(batch))
        return await super().generate_batch(batch, sampling_params, rid, **kw)

    async def generate(self, input_ids, sampling_params, session=None, rid=None, **kw):
        self.singles += 1
        return await super().generate(input_ids, sampling_params, session, rid, **kw)


def test_evaluation_is_batched_and_scores_what_single_requests_score(engine, tiny_model):
    scored = {}  # the text each row's answer was scored on
    spec = dataclasses.replace(get_task("arithmetic"), reward=lambda text, row: scored.setdefault(row.prompt, text) and 0.0)
    rows = spec.generate(2 * EVAL_BATCH + 2, digits=2)
    tok = AutoTokenizer.from_pretrained(tiny_model)
    params = {"temperature": 1.0, "max_new_tokens": 6}

    async def go():
        router = SpyRouter([engine.url])
        rollout = make_rollout(RolloutSetup(router, tok, tiny_model, spec, params, 6, AgentConfig()))
        try:
            scores = await rollout.evaluate(rows)
            calls = (list(router.batches), router.singles)
            singles = await asyncio.gather(*[router.generate(prompt_ids(tok, r), {"temperature": 0.0, "max_new_tokens": 6})
                                             for r in rows])
            return scores, calls, [o[0].text for o in singles]
        finally:
            await router.aclose()

    scores, calls, texts = run(go())
    assert calls == ([EVAL_BATCH, EVAL_BATCH, 2], 0)
    assert scores["eval/accuracy"] == 0.0 and [scored[r.prompt] for r in rows] == texts
