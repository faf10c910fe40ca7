"""Held-out evaluation: one answer per row through the router (greedy by default), scored by the task's verifier."""
from __future__ import annotations

import asyncio
from collections import defaultdict

from loongsage.rollout.router import Router
from loongsage.tasks.base import TaskRow, TaskSpec
from loongsage.tasks.prepare import prompt_ids


async def evaluate(router: Router, tokenizer, rows: list[TaskRow], spec: TaskSpec, max_new_tokens: int,
                   temperature: float = 0.0) -> dict[str, float]:
    params = {"temperature": temperature, "max_new_tokens": max_new_tokens}
    outs = await asyncio.gather(*[router.generate(prompt_ids(tokenizer, r), params, return_logprob=False) for r in rows])
    by_tag: dict[str, list[float]] = defaultdict(list)
    for row, out in zip(rows, outs):
        by_tag[row.tag].append(spec.reward(out[0].text, row))
    scores = [s for v in by_tag.values() for s in v]
    result = {"eval/accuracy": sum(scores) / len(scores)}
    if len(by_tag) > 1 or next(iter(by_tag)) != "default":
        for tag, v in by_tag.items():
            result[f"eval/{tag}/accuracy"] = sum(v) / len(v)
    return result
