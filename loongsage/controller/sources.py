"""The data sources of a run, each with its own data, task reward, rollout (agent), sampling,
sample buffer (its share of the staleness window) and producer; and how their groups become one
batch in exact proportions.

Every step takes `prompts_per_step` groups from each source's own buffer, so the proportions of a
step are exact by construction, in sync and fully async mode alike (each source admits only into its
own window). The samples are then ordered so that any split into equal contiguous parts (data-
parallel shards, mini-batches) gets every source in the same proportion, with lengths balanced
across the parts.
"""
from __future__ import annotations

import contextlib
from collections import Counter, defaultdict
from dataclasses import dataclass

from loongsage.agentflow.rollouts import make_rollout
from loongsage.buffer import SampleBuffer
from loongsage.controller.producer import RolloutProducer
from loongsage.controller.sampler import PromptSampler
from loongsage.rollout.single_turn import RolloutSetup
from loongsage.sample import Group, Sample
from loongsage.tasks.base import TaskRow, task_spec
from loongsage.tasks.prepare import prepare_data


@dataclass
class SourceRun:
    name: str
    cfg: object  # DataSourceConfig
    rollout: object  # api.Rollout
    buffer: SampleBuffer
    producer: RolloutProducer
    eval_rows: list[TaskRow]


def start_sources(cfg, router, tokenizer, model_dir: str, timeline=None, after_group=None) -> list[SourceRun]:
    """One SourceRun per data source (its data prepared, its rollout built, not started)."""
    runs = []
    for i, src in enumerate(cfg.sources()):
        train_rows, eval_rows = prepare_data(src.task)
        spec = task_spec(src.task)
        rollout = make_rollout(RolloutSetup(router, tokenizer, model_dir, spec, src.sampling.sampling_params(),
                                            src.sampling.max_new_tokens, src.agent))
        buffer = sample_buffer(cfg.rollout, src.prompts_per_step, len(cfg.sources()))
        mask_failures = src.agent.kind == "single_turn" or src.agent.on_failure == "mask"
        producer = RolloutProducer(rollout, PromptSampler(train_rows, cfg.seed + i), buffer, src.sampling.n,
                                   mask_failures, timeline, source=src.name,
                                   after_group=None if after_group is None else _bound(after_group, src),
                                   seed=cfg.seed * 101 + i if cfg.rollout.seeded_sampling else None)
        runs.append(SourceRun(src.name, src, rollout, buffer, producer,
                              eval_rows[: src.eval_size or cfg.train.eval_size or len(eval_rows)]))
    return runs


def sample_buffer(ro, prompts_per_step: int | None = None, sources: int = 1) -> SampleBuffer:
    """A source's buffer with the window strategy (`rollout.window`: a built-in name or module:attr),
    admitting `prompts_per_step` groups per version (its share of `rollout.max_inflight_groups`)."""
    from loongsage.extensions import resolve
    from loongsage.window import STRATEGIES

    b = prompts_per_step or ro.prompts_per_step
    strategy = STRATEGIES.get(ro.window) or resolve(ro.window, "window")
    cap = ro.max_inflight_groups
    if cap is not None and sources > 1:
        cap = max(1, round(cap * b / ro.prompts_per_step))
    return SampleBuffer(ro.max_staleness, b, cap or (ro.max_staleness + 1) * b, strategy())


def _bound(after_group, src):
    async def call(group: Group) -> None:
        await after_group(group, src)
    return call


def stratify(samples: list[Sample], parts: int) -> list[Sample]:
    """An order of `samples` in which every one of `parts` equal contiguous slices holds each source's
    samples in the batch's proportion (exactly, when each source's count divides by `parts`), and
    the tokens of each source spread evenly over the slices (longest first, snake order)."""
    if parts <= 1:
        return list(samples)
    slices: list[list[Sample]] = [[] for _ in range(parts)]
    by_source: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_source[s.source].append(s)
    load = [0] * parts
    for _, group in sorted(by_source.items()):
        ordered = sorted(group, key=lambda s: -(len(s.prompt_ids) + len(s.response_ids)))
        for k in range(0, len(ordered), parts):  # each round gives every slice one, the lightest the longest
            chunk = ordered[k: k + parts]
            for s, p in zip(chunk, sorted(range(parts), key=lambda p: (load[p], len(slices[p])))):
                slices[p].append(s)
                load[p] += len(s.prompt_ids) + len(s.response_ids)
    return [s for sl in slices for s in sl]


def source_metrics(sources: list[str], sampled: list[Group], trained: list[Sample]) -> dict[str, float]:
    """Per source (when there are several): reward mean of the groups drawn, samples trained; per
    teacher: the trained samples it scored."""
    out: dict[str, float] = {}
    for name, n in Counter(t for s in trained for t in s.teacher).items():
        out[f"teacher/{name}/samples"] = float(n)
    if len(sources) < 2:
        return out
    rewards = defaultdict(list)
    for g in sampled:
        rewards[g.source].extend(g.rewards)
    counts = Counter(s.source for s in trained)
    for name in sources:
        out[f"samples/{name}/trained"] = float(counts.get(name, 0))
        if rewards[name]:
            out[f"reward/{name}/mean"] = sum(rewards[name]) / len(rewards[name])
    return out


@contextlib.contextmanager
def admissions_held(runs: list[SourceRun]):
    """No new group is admitted inside (groups in flight go on): the controller holds admissions
    from before the weight update an evaluation waits for until the evaluation ends. Groups admitted
    as the engines took the held-out rows' prefills made both slower (a synchronous arith step after
    an evaluation took 0.54 s against 0.29, the evaluation 0.42 s against ~0.3 alone) and charged the
    evaluation's time to the next step."""
    for r in runs:
        r.producer.admitting.clear()
    try:
        yield
    finally:
        for r in runs:
            r.producer.admitting.set()


async def evaluate_sources(runs: list[SourceRun], temperature: float) -> dict[str, float]:
    """`eval/accuracy` (the mean over sources) and, with several sources, `eval/<source>/accuracy`."""
    results = {r.name: await r.rollout.evaluate(r.eval_rows, temperature) for r in runs}
    if len(runs) == 1:
        return next(iter(results.values()))
    out: dict[str, float] = {}
    for name, res in results.items():
        for key, value in res.items():
            out[key.replace("eval/", f"eval/{name}/", 1)] = value
    out["eval/accuracy"] = sum(res["eval/accuracy"] for res in results.values()) / len(results)
    return out
