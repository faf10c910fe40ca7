"""`loongsage train`: the RL run loop, top to bottom.

    producer task (controller/producer.py) ──────────────── consumer: this loop
      admits a prompt while the window has room               takes B informative, in-window groups
      ─► router ─► engines (Ray actors, HTTP): n samples      ─► advantages ─► TrainBatch
         + behaviour logprobs + per-token versions            ─► trainer ranks (Ray, FSDP2):
      ─► verifier rewards ─► buffer (asyncio.Queue)              proximal logprobs, train_step ─► v+1
                                                              ─► engines pause (in_place/retract),
                                                                 weights broadcast, version confirmed,
                                                                 continue; too-old in-flight cancelled

Back-pressure is the staleness window (loongsage/buffer.py): at most (k + 1 + v) * B groups are ever
admitted by version v, so generation runs at most k versions ahead of training. With k = 0 nothing is
admitted until the weights of the previous step are on the engines: the synchronous schedule, by the
same code path. Groups found stale anyway are evicted and counted (`samples/dropped_stale`).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import AutoTokenizer

from loongsage.algo import advantages as adv
from loongsage.algo.mismatch import train_inference_gap
from loongsage.buffer import StalenessWindow
from loongsage.config import RunConfig, dump_config
from loongsage.controller.bootstrap import ensure_base_policy
from loongsage.controller.evaluate import evaluate
from loongsage.controller.producer import RolloutProducer
from loongsage.controller.runtime import Runtime
from loongsage.controller.sampler import PromptSampler
from loongsage.metrics import MetricsWriter
from loongsage.sample import Sample
from loongsage.tasks.base import get_task
from loongsage.tasks.prepare import prepare_data
from loongsage.timeline import Timeline
from loongsage.trainer.batch import collate


async def train(cfg: RunConfig) -> dict:
    console = Console()
    run_dir = cfg.resolve_run_dir()
    dump_config(cfg, run_dir / "config.yaml")
    base = await ensure_base_policy(cfg, console)
    train_rows, eval_rows = prepare_data(cfg.task)
    eval_rows = eval_rows[: cfg.train.eval_size or len(eval_rows)]
    spec, tok = get_task(cfg.task.name), AutoTokenizer.from_pretrained(base)
    rt = await Runtime.start(str(base), cfg.trainer, cfg.engine, cfg.rollout, cfg.ray,
                             with_reference=cfg.algo.loss.kl_coef > 0)
    metrics = MetricsWriter(run_dir)
    ro = cfg.rollout
    window = StalenessWindow(ro.max_staleness, ro.prompts_per_step,
                             ro.max_inflight_groups or (ro.max_staleness + 1) * ro.prompts_per_step)
    timeline = Timeline()
    producer = RolloutProducer(rt, tok, spec, PromptSampler(train_rows, cfg.seed), window,
                               cfg.sampling.sampling_params(), cfg.sampling.n, timeline)
    t_start = time.perf_counter()
    summary: dict = {"run_dir": str(run_dir), "base_policy": str(base)}
    producing = None
    try:
        first = await evaluate(rt.router, tok, eval_rows, spec, cfg.sampling.max_new_tokens)
        metrics.write({"step": 0, "version": 0, **first})
        summary["eval_before"] = first["eval/accuracy"]
        console.print(f"held-out accuracy before training: {first['eval/accuracy']:.3f}")
        producing = asyncio.create_task(producer.run())
        clock = _Clock(producer)
        with _progress(console) as bar:
            task = bar.add_task("train", total=cfg.train.steps, reward=0.0, rate=0.0)
            for step in range(1, cfg.train.steps + 1):
                record = await _step(step, cfg, rt, tok, producer, window, clock, timeline)
                if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                    with timeline.span("eval", f"eval {step}"):
                        record.update(await evaluate(rt.router, tok, eval_rows, spec, cfg.sampling.max_new_tokens))
                metrics.write(record)
                bar.update(task, advance=1, reward=record["reward/mean"],
                           rate=record["samples/trained"] / record["time/step_s"])
                if cfg.train.save_every and step % cfg.train.save_every == 0:
                    await rt.trainers.save(str(run_dir / "checkpoints" / f"step_{step}"))
                if cfg.train.max_minutes and time.perf_counter() - t_start > 60 * cfg.train.max_minutes:
                    console.print(f"stopping: train.max_minutes={cfg.train.max_minutes} reached at step {step}")
                    break
        producing.cancel()
        await producer.stop()  # the engines are free for the final evaluation
        producing = None
        if "eval/accuracy" not in record:  # always end with a held-out evaluation
            record = {"step": step, "version": step,
                      **await evaluate(rt.router, tok, eval_rows, spec, cfg.sampling.max_new_tokens)}
            metrics.write(record)
        await rt.trainers.save(str(run_dir / "checkpoints" / "final"))
        summary.update(eval_after=record["eval/accuracy"], steps=step, train_seconds=time.perf_counter() - t_start)
        console.print(f"held-out accuracy: {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} "
                      f"after {step} steps ({summary['train_seconds']:.0f}s); run dir {run_dir}")
    finally:
        if producing is not None:
            producing.cancel()
            await producer.stop()
        timeline.save(run_dir / "timeline.json")
        metrics.close()
        await rt.close()
    return summary


async def _step(step: int, cfg: RunConfig, rt: Runtime, tok, producer: RolloutProducer,
                window: StalenessWindow, clock: "_Clock", timeline: Timeline) -> dict:
    with timeline.span("controller: wait for batch", f"batch {step}"):
        groups, sampled, dropped = await _take_batch(step, cfg, producer, window)
    samples = [s for g in groups for s in g]
    record: dict = {"step": step, "version": step, "samples/trained": len(samples),
                    "samples/dropped_stale": dropped, "samples/filtered_groups": len(sampled) - len(groups)}
    record.update(_reward_metrics(sampled))
    t_train = time.perf_counter()
    if samples:
        batch = collate(samples, tok.pad_token_id)
        proximal, _ = await rt.trainers.compute_logprobs(batch)
        batch.proximal_logprobs = proximal
        if rt.reference is not None:
            batch.ref_logprobs, _ = await rt.reference.compute_logprobs(batch)
        record.update(train_inference_gap(batch.behavior_logprobs, proximal, batch.loss_mask))
        record.update(await rt.trainers.train_step(batch, "policy", cfg.algo.loss))
        record.update(_staleness_metrics(step, samples))
    else:  # nothing informative arrived: no update, but the version still advances with the sync
        record.update({"staleness/mean": 0.0, "staleness/max": 0.0, "mismatch/kl": 0.0,
                       "mismatch/abs_logprob_diff": 0.0})
    clock.train_s += time.perf_counter() - t_train
    timeline.add("trainer: train", f"train {step}", t_train, time.perf_counter())
    with timeline.span("weight sync", f"sync v{step}"):
        record.update(await _update_weights(step, cfg, rt, producer, window))
    record.update(clock.lap())
    return record


async def _take_batch(step, cfg: RunConfig, producer: RolloutProducer, window: StalenessWindow):
    """B groups in the window with a learning signal; stale ones are evicted, uninformative ones
    (all rewards equal, with dynamic sampling) discarded and replaced, up to a per-step cap."""
    want = cfg.rollout.prompts_per_step
    cap = cfg.rollout.max_sampling_rounds * want
    groups, sampled, dropped = [], [], 0
    while len(groups) < want and len(sampled) < cap:
        group = await producer.buffer.get()
        if window.is_stale(min(s.min_version for s in group), step):
            window.evict()
            dropped += len(group)
        elif cfg.rollout.dynamic_sampling and not adv.keep_informative_groups(torch.tensor([[s.reward for s in group]]))[0]:
            window.discard()
            sampled.append(group)
        else:
            groups.append(group)
            sampled.append(group)
        producer.poke()
    window.consume(len(groups))
    if groups:
        advantages = adv.compute(cfg.algo.advantage, torch.tensor([[s.reward for s in g] for g in groups]))
        for g, a in zip(groups, advantages):
            for s, value in zip(g, a.tolist()):
                s.advantage = value
    return groups, sampled, dropped


async def _update_weights(step, cfg: RunConfig, rt: Runtime, producer: RolloutProducer,
                          window: StalenessWindow) -> dict:
    """Engines hold in-flight requests (pause mode), take version `step`, continue; then the window
    advances and in-flight groups that can no longer be trained in time are cancelled."""
    mode = cfg.rollout.pause_mode
    clients = rt.router.clients
    if mode != "none":
        await asyncio.gather(*[c.pause(mode) for c in clients])
    try:
        out = await rt.sync.push(step)
    finally:
        if mode != "none":
            await asyncio.gather(*[c.resume() for c in clients])
    window.advance()
    cancelled = await producer.cancel_too_old()
    producer.poke()
    out["samples/cancelled"] = cancelled * cfg.sampling.n
    return out


class _Clock:
    """Per-step wall time and the busy fractions of generation and training within it."""

    def __init__(self, producer: RolloutProducer):
        self.producer, self.train_s = producer, 0.0
        self._t, self._gen = time.perf_counter(), producer.busy.now()

    def lap(self) -> dict[str, float]:
        now, gen = time.perf_counter(), self.producer.busy.now()
        total = max(now - self._t, 1e-9)
        out = {"time/step_s": total, "time/generate_s": gen - self._gen, "time/train_s": self.train_s,
               "time/generate_busy_frac": min(1.0, (gen - self._gen) / total),
               "time/train_busy_frac": min(1.0, self.train_s / total)}
        self._t, self._gen, self.train_s = now, gen, 0.0
        return out


def _staleness_metrics(step: int, samples: list[Sample]) -> dict[str, float]:
    staleness = [(step - 1) - s.min_version for s in samples]
    out = {"staleness/mean": sum(staleness) / len(staleness), "staleness/max": float(max(staleness))}
    for value, count in sorted(Counter(staleness).items()):
        out[f"staleness/hist/{value}"] = count
    return out


def _reward_metrics(groups: list[list[Sample]]) -> dict[str, float]:
    by_tag = defaultdict(list)
    for g in groups:
        for s in g:
            by_tag[s.tag].append(s.reward)
    allr = [r for v in by_tag.values() for r in v]
    out = {"reward/mean": sum(allr) / len(allr) if allr else 0.0}
    for tag, v in by_tag.items():
        out[f"reward/{tag}/mean"] = sum(v) / len(v)
    return out


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                    TextColumn("reward {task.fields[reward]:.3f}"), TextColumn("{task.fields[rate]:.0f} samples/s"),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console, transient=False)
