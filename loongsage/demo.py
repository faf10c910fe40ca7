"""`loongsage demo`: the engine end to end on a fresh machine.

Builds (or reuses) the recipe's tiny model and task data, starts the embedded engine as its own
process, sends the held-out prompts concurrently (continuous batching), scores them with the
task's verifier, round-trips a weight update, and writes a summary into the run directory.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from loongsage.cliargs import flags_of
from loongsage.config import RunConfig, dump_config
from loongsage.models.prepare import resolve_model
from loongsage.rollout.client import EngineClient
from loongsage.rollout.launcher import launch_engine
from loongsage.tasks.base import task_spec
from loongsage.tasks.prepare import prepare_data, prompt_ids


def run_demo(cfg: RunConfig) -> dict:
    console = Console()
    run_dir = cfg.resolve_run_dir()
    dump_config(cfg, run_dir / "config.yaml")
    model_dir = resolve_model(cfg.model)
    _, eval_rows = prepare_data(cfg.task)
    rows = eval_rows[: cfg.demo.num_prompts]
    tok = AutoTokenizer.from_pretrained(model_dir)
    spec = task_spec(cfg.task)
    console.print(f"[bold]model[/] {model_dir}  [bold]task[/] {cfg.task.name} ({len(rows)} prompts)  "
                  f"[bold]run dir[/] {run_dir}")
    with launch_engine(str(model_dir), threads=cfg.engine.threads or 1, extra_args=flags_of(cfg.engine),
                       log_path=str(run_dir / "engine.log"), api_key=secrets.token_urlsafe(32)) as engine:
        summary = asyncio.run(_exercise(EngineClient(engine.url, engine.api_key), tok, rows, spec, cfg, model_dir))
    table = Table(title="embedded engine demo")
    for key in ("requests", "output_tokens", "tokens_per_s", "reward_mean", "weight_version_after_update",
                "outputs_equal_after_reload"):
        table.add_row(key, str(summary[key]))
    console.print(table)
    for sample in summary["samples"][:3]:
        console.print(f"  {sample['prompt']!r} -> {sample['text']!r} (answer {sample['answer']})")
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"summary written to {run_dir / 'summary.json'}")
    return summary


async def _exercise(client: EngineClient, tok, rows, spec, cfg: RunConfig, model_dir: Path) -> dict:
    try:
        params = cfg.sampling.sampling_params()
        t0 = time.perf_counter()
        outs = await asyncio.gather(*[client.generate(prompt_ids(tok, r), params) for r in rows])
        elapsed = time.perf_counter() - t0
        rewards = [spec.reward(o.text, r) for o, r in zip(outs, rows)]
        greedy = {"temperature": 0.0, "max_new_tokens": cfg.sampling.max_new_tokens}
        probe = prompt_ids(tok, rows[0])
        before = await client.generate(probe, greedy)
        await client.update_weights_from_disk(str(model_dir), weight_version=1)
        after = await client.generate(probe, greedy)
        n_tok = sum(len(o.output_ids) for o in outs)
        return {
            "requests": len(rows), "output_tokens": n_tok, "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(n_tok / elapsed, 1), "reward_mean": sum(rewards) / len(rewards),
            "weight_version_after_update": after.weight_version,
            "outputs_equal_after_reload": before.output_ids == after.output_ids,
            "samples": [{"prompt": r.prompt if isinstance(r.prompt, str) else r.prompt[-1]["content"],
                         "text": o.text, "answer": r.answer, "finish": o.finish_reason}
                        for o, r in zip(outs, rows)],
        }
    finally:
        await client.aclose()
