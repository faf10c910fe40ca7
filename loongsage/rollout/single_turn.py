"""Single-turn rollouts: one prompt, n samples from the engine, rewards from the verifier.
(Multi-turn and tool-using agents are AgentFlow's; they produce the same `Sample`s.)"""
from __future__ import annotations

from loongsage.rollout.router import Router
from loongsage.sample import Sample
from loongsage.tasks.base import TaskRow, TaskSpec
from loongsage.tasks.prepare import prompt_ids


async def sample_group(router: Router, tokenizer, row: TaskRow, spec: TaskSpec, sampling_params: dict,
                       n: int, group: int, rid: str | None = None) -> list[Sample]:
    ids = prompt_ids(tokenizer, row)
    outs = await router.generate(ids, {**sampling_params, "n": n}, session=f"group-{group}", return_logprob=True,
                                 rid=rid)
    samples = []
    for o in outs:
        samples.append(Sample(
            prompt_ids=ids, response_ids=o.output_ids, loss_mask=[1] * len(o.output_ids),
            behavior_logprobs=o.output_logprobs, versions=o.versions, reward=spec.reward(o.text, row), tag=row.tag,
            status="truncated" if o.finish_type == "length" else ("failed" if o.finish_type == "abort" else "ok"),
            group=group, text=o.text))
    return samples
