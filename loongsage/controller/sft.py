"""Supervised fine-tuning with the same trainer backend, engines and weight sync as RL.

Targets are each row's answer followed by the end token; the loss covers only those tokens.
Every `eval_every` steps the weights go to the engine and dev accuracy (train rows held back)
decides whether the target competence is reached.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from transformers import AutoTokenizer

from loongsage.agentflow.chat_tokens import ChatTokens
from loongsage.agentflow.rollouts import make_rollout
from loongsage.agentflow.trajectory import demonstration_chain
from loongsage.config import dump_config
from loongsage.controller.runtime import Runtime
from loongsage.models.prepare import resolve_model
from loongsage.rollout.single_turn import RolloutSetup
from loongsage.sample import Sample
from loongsage.tasks.base import TaskRow, TaskSpec, task_spec
from loongsage.tasks.prepare import prepare_data, prompt_ids
from loongsage.trainer.batch import collate
from loongsage.trainer.config import TrainerConfig


def sft_sample(tokenizer, row: TaskRow, spec: TaskSpec | None = None, chat: ChatTokens | None = None) -> Sample:
    """The row's answer as the target, or for agent tasks the task's demonstration (tool calls and
    answer trained, tool results inserted) as one multi-turn sample."""
    if spec is not None and spec.demonstration is not None and isinstance(row.prompt, list):
        c = demonstration_chain(chat or ChatTokens(tokenizer), row.prompt, row.tools, spec.demonstration(row))
        return Sample(c.prompt_ids, c.response_ids, c.loss_mask, c.logprobs, c.versions, tag=row.tag)
    ids = prompt_ids(tokenizer, row)
    end = tokenizer.eos_token if isinstance(row.prompt, str) else "<|im_end|>"
    target = tokenizer(row.answer + end, add_special_tokens=False)["input_ids"]
    n = len(target)
    return Sample(ids, target, [1] * n, [0.0] * n, [-1] * n, tag=row.tag)


@dataclass
class SFTSource:
    """One data source's part of an SFT run: its rows, dev rows and the rollout that scores them."""
    name: str
    rows: list[TaskRow]
    dev: list[TaskRow]
    spec: TaskSpec
    rollout: object = None


async def run_sft(rt: Runtime, tokenizer, sources: list[SFTSource], cfg, chat: ChatTokens, seed: int = 0,
                  console: Console | None = None) -> dict:
    """`cfg` is an SFTConfig. Batches mix the sources' rows as they are mixed in the data; dev accuracy
    is each source's rollout's (greedy), averaged over the sources. Returns the last dev accuracy
    (and per source), steps and seconds."""
    console = console or Console()
    rng = random.Random(seed)
    samples = [sft_sample(tokenizer, r, src.spec, chat) for src in sources for r in src.rows]
    t0 = time.perf_counter()
    acc, per_source, step = 0.0, {}, 0
    for step in range(1, cfg.max_steps + 1):
        batch = collate(rng.sample(samples, min(cfg.batch_size, len(samples))), tokenizer.pad_token_id)
        m = await rt.trainers.train_step(batch, "sft", None)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            await rt.sync.push(step)
            per_source = {src.name: (await src.rollout.evaluate(src.dev))["eval/accuracy"] for src in sources}
            acc = sum(per_source.values()) / len(per_source)
            shown = "" if len(per_source) == 1 else " (" + ", ".join(f"{k} {v:.3f}" for k, v in per_source.items()) + ")"
            console.print(f"[sft] step {step}: loss {m['loss/sft']:.3f}, dev accuracy {acc:.3f}{shown} "
                          f"({time.perf_counter() - t0:.0f}s)")
            if cfg.target_accuracy is not None and acc >= cfg.target_accuracy:
                break
    return {"dev_accuracy": acc, "dev_accuracy_by_source": per_source, "steps": step,
            "seconds": time.perf_counter() - t0}


async def sft_to(cfg, init: Path, out: Path, console: Console) -> dict:
    """SFT the model at `init` on the run config's data sources (cfg.bootstrap.sft settings); saves
    to `out`. Each source holds back `dev_size` rows (split evenly among sources) for dev accuracy."""
    sft = cfg.bootstrap.sft
    specs = cfg.sources()
    dev_size = max(1, sft.dev_size // len(specs))
    parts = []
    for src in specs:
        train_rows, _ = prepare_data(src.task)
        if len(train_rows) <= dev_size:
            raise ValueError(f"bootstrap.sft.dev_size ({sft.dev_size}) leaves no SFT rows of {len(train_rows)} "
                             f"in source {src.name!r}")
        parts.append(SFTSource(src.name, train_rows[:-dev_size], train_rows[-dev_size:], task_spec(src.task)))
    trainer = sft_trainer(cfg.trainer, sft)
    rt = await Runtime.start(str(init), trainer, cfg.engine, cfg.rollout, cfg.ray, transfer=cfg.transfer)
    try:
        tok = AutoTokenizer.from_pretrained(init)
        for part, src in zip(parts, specs):
            # Dev accuracy of an agent policy is measured with the white-box tool loop, for black-box recipes
            # too (the same protocol; no process per dev row), so both kinds share one cached base policy.
            agent = src.agent if src.agent.kind != "blackbox" else src.agent.model_copy(update={"kind": "whitebox"})
            part.rollout = make_rollout(RolloutSetup(rt.router, tok, str(init), part.spec,
                                                     src.sampling.sampling_params(), src.sampling.max_new_tokens,
                                                     agent))
            await part.rollout.start()
        result = await run_sft(rt, tok, parts, sft, ChatTokens(tok, str(init)), cfg.seed, console)
        await rt.trainers.save(str(out))
    finally:
        for part in parts:
            if part.rollout is not None:
                await part.rollout.stop()
        await rt.close()
    (out / "sft.json").write_text(json.dumps(result))
    return result


async def sft_command(cfg) -> dict:
    """`loongsage sft CONFIG`: SFT into RUN_DIR/checkpoints/final."""
    console = Console()
    run_dir = cfg.resolve_run_dir()
    dump_config(cfg, run_dir / "config.yaml")
    result = await sft_to(cfg, resolve_model(cfg.model), run_dir / "checkpoints" / "final", console)
    console.print(f"[sft] dev accuracy {result['dev_accuracy']:.3f} after {result['steps']} steps; "
                  f"model at {run_dir / 'checkpoints' / 'final'}")
    return result


def sft_trainer(trainer: TrainerConfig, sft) -> TrainerConfig:
    """The run's trainer with the SFT's optimizer settings: its own lr, betas and warm-up, a constant
    schedule (the run's decay is the run's), fp32; `sft.threads` if set, then unpinned (the run's
    cpu_affinity keeps the trainer off the engine's core, which idles between dev evaluations)."""
    own = {"threads": sft.threads, "cpu_affinity": None} if sft.threads else {}
    return TrainerConfig(**{**trainer.model_dump(), "lr": sft.lr, "betas": sft.betas, "warmup_steps": sft.warmup_steps,
                            "lr_schedule": "constant", "total_steps": None, "decay_steps": None, "bf16": False, **own})
