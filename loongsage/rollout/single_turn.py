"""Single-turn rollouts: one prompt, n samples from the engine in one request, rewards from the
verifier; held-out evaluation is one answer per row. (Multi-turn and tool-using agents are
AgentFlow's, `agentflow/rollouts.py`; all produce the same `Group`s.)"""
from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

from loongsage.rollout.router import Router
from loongsage.sample import Group, Sample, scoring_temperature
from loongsage.tasks.base import TaskRow, TaskSpec
from loongsage.tasks.prepare import prompt_ids


def group_session(gid: int) -> str:
    return f"g{gid}"


def in_group(session: str | None, gid: int) -> bool:
    """Whether a router session belongs to group `gid` (its own, or one of its episodes' `g<gid>-...`,
    also behind a gateway prefix `gw-`)."""
    if session is None:
        return False
    name = session.removeprefix("gw-")
    return name == f"g{gid}" or name.startswith(f"g{gid}-")


@dataclass
class RolloutSetup:
    """What every rollout kind is built from (`agentflow.rollouts.make_rollout`)."""
    router: Router
    tokenizer: object
    model_dir: str
    spec: TaskSpec
    sampling: dict  # SGLang sampling_params of the policy
    max_new_tokens: int
    agent: object = None  # AgentConfig
    extra: dict = field(default_factory=dict)


EVAL_BATCH = 64  # held-out rows per request: per-request costs (HTTP, parsing) paid once per 64 rows
_STATUS = {"length": "truncated", "abort": "aborted"}  # an abort the router could not continue: the system's


class SingleTurnRollout:
    def __init__(self, setup: RolloutSetup):
        self.router, self.tok, self.spec = setup.router, setup.tokenizer, setup.spec
        self.sampling, self.max_new_tokens = dict(setup.sampling), setup.max_new_tokens

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def group(self, row: TaskRow, n: int, gid: int, seed: int | None = None) -> Group:
        ids = prompt_ids(self.tok, row)
        session = group_session(gid)
        params = {**self.sampling, "n": n, **({} if seed is None else {"sampling_seed": seed})}  # sample j: seed + j
        outs = await self.router.generate(ids, params, session=session, return_logprob=True, rid=session)
        temp = scoring_temperature(self.sampling.get("temperature"))
        samples = [Sample(
            prompt_ids=ids, response_ids=o.output_ids, loss_mask=[1] * len(o.output_ids),
            behavior_logprobs=o.output_logprobs, versions=o.versions, reward=self.spec.reward(o.text, row),
            tag=row.tag, status=_STATUS.get(o.finish_type, "ok"),
            group=gid, text=o.text, temperatures=None if temp == 1.0 else [temp] * len(o.output_ids)) for o in outs]
        return Group(samples, [s.reward for s in samples], row.tag, aborted=sum(s.status == "aborted" for s in samples),
                     stats={"resumed_calls": sum(o.resumed > 0 for o in outs)})

    async def cancel(self, gid: int) -> int:
        return await self.router.abort_where(lambda s: in_group(s, gid))

    async def evaluate(self, rows: list[TaskRow], temperature: float = 0.0) -> dict[str, float]:
        """Held-out success: one answer per row (greedy unless a temperature is given), scored by the
        task's verifier."""
        params = {"temperature": temperature, "max_new_tokens": self.max_new_tokens}
        prompts = [prompt_ids(self.tok, r) for r in rows]
        parts = await asyncio.gather(*[self.router.generate_batch(prompts[i:i + EVAL_BATCH], params, return_logprob=False)
                                       for i in range(0, len(prompts), EVAL_BATCH)])
        outs = [o for part in parts for o in part]
        return accuracy_by_tag(rows, [self.spec.reward(o.text, r) for r, o in zip(rows, outs)])


def accuracy_by_tag(rows: list[TaskRow], scores: list[float]) -> dict[str, float]:
    """`eval/accuracy`, and `eval/<tag>/accuracy` when the rows have tags."""
    by_tag: dict[str, list[float]] = defaultdict(list)
    for row, score in zip(rows, scores):
        by_tag[row.tag].append(score)
    out = {"eval/accuracy": sum(scores) / len(scores)}
    if len(by_tag) > 1 or next(iter(by_tag)) != "default":
        for tag, v in by_tag.items():
            out[f"eval/{tag}/accuracy"] = sum(v) / len(v)
    return out
