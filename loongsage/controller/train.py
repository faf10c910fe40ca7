"""`loongsage train`: the RL run loop, top to bottom.

    controller (this process, asyncio)
      ├─ sample prompts ─► router ─► engines (Ray actors, HTTP)  ─► n samples / prompt + rewards
      │     dynamic sampling: groups with all-equal rewards are dropped and more are drawn
      ├─ advantages (algo) ─► collate ─► trainer group (Ray actors, FSDP2)
      │     compute_logprobs (proximal) ─► train_step (decoupled PPO + IS) ─► version v+1
      └─ weight sync: trainer rank 0 ─broadcast─► engines (/update_weights_from_distributed),
            each engine confirms v+1 before it serves again; held-out eval every `eval_every`.

This loop is synchronous: generation for step t uses exactly version t-1 (staleness 0), and the
engine is idle while the trainer works. The asynchronous pipeline (sliding staleness window,
partial rollouts) replaces the "generate" phase with a producer that runs ahead, same metrics.
"""
from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import AutoTokenizer

from loongsage.algo import advantages as adv
from loongsage.algo.mismatch import train_inference_gap
from loongsage.config import RunConfig, dump_config
from loongsage.controller.bootstrap import ensure_base_policy
from loongsage.controller.evaluate import evaluate
from loongsage.controller.runtime import Runtime
from loongsage.controller.sampler import PromptSampler
from loongsage.metrics import MetricsWriter
from loongsage.rollout.single_turn import sample_group
from loongsage.sample import Sample
from loongsage.tasks.base import get_task
from loongsage.tasks.prepare import prepare_data
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
    sampler = PromptSampler(train_rows, cfg.seed)
    t_start = time.perf_counter()
    summary: dict = {"run_dir": str(run_dir), "base_policy": str(base)}
    try:
        first = await evaluate(rt.router, tok, eval_rows, spec, cfg.sampling.max_new_tokens)
        metrics.write({"step": 0, "version": 0, **first})
        summary["eval_before"] = first["eval/accuracy"]
        console.print(f"held-out accuracy before training: {first['eval/accuracy']:.3f}")
        last_eval = first
        with _progress(console) as bar:
            task = bar.add_task("train", total=cfg.train.steps, reward=0.0, rate=0.0)
            for step in range(1, cfg.train.steps + 1):
                record, last_eval = await _step(step, cfg, rt, tok, spec, sampler, eval_rows, last_eval)
                metrics.write(record)
                bar.update(task, advance=1, reward=record["reward/mean"],
                           rate=record["samples/trained"] / record["time/step_s"])
                if cfg.train.save_every and step % cfg.train.save_every == 0:
                    await rt.trainers.save(str(run_dir / "checkpoints" / f"step_{step}"))
                if cfg.train.max_minutes and time.perf_counter() - t_start > 60 * cfg.train.max_minutes:
                    console.print(f"stopping: train.max_minutes={cfg.train.max_minutes} reached at step {step}")
                    break
        if "eval/accuracy" not in record:  # always end with a held-out evaluation
            last_eval = await evaluate(rt.router, tok, eval_rows, spec, cfg.sampling.max_new_tokens)
            metrics.write({"step": step, "version": step, **last_eval})
        await rt.trainers.save(str(run_dir / "checkpoints" / "final"))
        summary.update(eval_after=last_eval["eval/accuracy"], steps=step, train_seconds=time.perf_counter() - t_start)
        console.print(f"held-out accuracy: {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} "
                      f"after {step} steps ({summary['train_seconds']:.0f}s); run dir {run_dir}")
    finally:
        metrics.close()
        await rt.close()
    return summary


async def _step(step, cfg: RunConfig, rt: Runtime, tok, spec, sampler, eval_rows, last_eval):
    t0 = time.perf_counter()
    groups, sampled = await _collect_groups(step, cfg, rt, tok, spec, sampler)
    t_gen = time.perf_counter() - t0
    samples = [s for g in groups for s in g]
    record: dict = {"step": step, "version": step, "samples/trained": len(samples),
                    "samples/dropped_stale": 0, "samples/filtered_groups": len(sampled) - len(groups)}
    record.update(_reward_metrics(sampled))
    t1 = time.perf_counter()
    if samples:
        batch = collate(samples, tok.pad_token_id)
        proximal, _ = await rt.trainers.compute_logprobs(batch)
        batch.proximal_logprobs = proximal
        if rt.reference is not None:
            batch.ref_logprobs, _ = await rt.reference.compute_logprobs(batch)
        record.update(train_inference_gap(batch.behavior_logprobs, proximal, batch.loss_mask))
        record.update(await rt.trainers.train_step(batch, "policy", cfg.algo.loss))
        versions = torch.tensor([s.min_version for s in samples], dtype=torch.float32)
        staleness = (step - 1) - versions
        record.update({"staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max())})
    else:  # nothing informative this step: no update, but the version still advances with the sync
        record.update({"staleness/mean": 0.0, "staleness/max": 0.0, "mismatch/kl": 0.0,
                       "mismatch/abs_logprob_diff": 0.0})
    t_train = time.perf_counter() - t1
    record.update(await rt.sync.push(step))
    if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
        last_eval = await evaluate(rt.router, tok, eval_rows, spec, cfg.sampling.max_new_tokens)
        record.update(last_eval)
    total = time.perf_counter() - t0
    record.update({"time/step_s": total, "time/generate_s": t_gen, "time/train_s": t_train,
                   "time/generate_busy_frac": t_gen / total, "time/train_busy_frac": t_train / total})
    return record, last_eval


async def _collect_groups(step, cfg: RunConfig, rt: Runtime, tok, spec, sampler):
    """`prompts_per_step` groups of n samples with advantages (and every group sampled, for reward
    metrics); with dynamic sampling, groups whose rewards are all equal are dropped and redrawn."""
    want, groups, sampled = cfg.rollout.prompts_per_step, [], []
    params = cfg.sampling.sampling_params()
    for _ in range(cfg.rollout.max_sampling_rounds):
        rows = sampler.take(want - len(groups))
        base = step * 1_000_000 + len(sampled)
        got = await asyncio.gather(*[sample_group(rt.router, tok, r, spec, params, cfg.sampling.n, base + i)
                                     for i, r in enumerate(rows)])
        sampled += got
        groups += [g for g in got if not (cfg.rollout.dynamic_sampling and len({s.reward for s in g}) == 1)]
        if len(groups) >= want or not cfg.rollout.dynamic_sampling:
            break
    if groups:
        rewards = torch.tensor([[s.reward for s in g] for g in groups])
        advantages = adv.compute(cfg.algo.advantage, rewards)
        for g, a in zip(groups, advantages):
            for s, value in zip(g, a.tolist()):
                s.advantage = value
    return groups, sampled


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
