"""Wall clock to the same held-out accuracy: LoongSage (async, k = 1) vs TRL's GRPOTrainer on CPU,
from the same bootstrapped base model, with the same group size, prompts per step, max new tokens,
learning rate, clip range and grad clip, evaluated greedily on the same held-out rows.

    pip install -c constraints/cpu.txt -e .[bench]     # TRL is an extra, only for this benchmark
    python benchmarks/vs_trl.py [--target 0.40] [--max-steps 400] [--eval-every 10] [recipe overrides ...]

Each framework uses both cores its own best way: LoongSage pins its trainer (1 thread) to core 0
and its engine and controller to core 1; TRL runs in one process with 2 torch threads. Times start
at each framework's entry point (start-up included: Ray and engines, or model load and trainer
set-up), exclude the shared bootstrap and every evaluation, and stop at the first evaluation at
or above the target. The last line is one JSON object:
{"target_accuracy", "loongsage_s", "trl_s", "ratio", ..., "loongsage_per_step", "trl_per_step"} with
ratio = trl_s / loongsage_s; the per-step objects split a step into generation and training (seconds),
which shows where each framework's time goes. The default target (0.40 from ~0.31) is one both reach
within 400 steps in every run so far; 0.45 is reached in some runs only (eval noise is ~+-0.02).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time

import torch
from rich.console import Console

from loongsage.config import RunConfig, load_config
from loongsage.controller.bootstrap import ensure_base_policy
from loongsage.controller.train import train
from loongsage.metrics import read_metrics
from loongsage.tasks.base import TaskRow, get_task
from loongsage.tasks.prepare import prepare_data


def run_loongsage(cfg: RunConfig) -> dict:
    asyncio.run(train(cfg))
    curve, eval_s, steps = [], 0.0, []
    for r in read_metrics(cfg.run_dir):
        eval_s += r.get("time/eval_s", 0.0)
        if "eval/accuracy" in r:
            curve.append((r["step"], round(r["time/elapsed_s"] - eval_s, 2), r["eval/accuracy"]))
        if r["step"] > 0 and "time/train_s" in r:
            steps.append(r)
    n = max(len(steps), 1)
    per_step = {"step_s": round(sum(r["time/step_s"] - r.get("time/eval_s", 0.0) for r in steps) / n, 4),
                **{k: round(sum(r[f"time/{k}"] for r in steps) / n, 4) for k in ("generate_s", "train_s")}}
    return {"curve": curve, "per_step": per_step}


def greedy_accuracy(model, tok, rows: list[TaskRow], spec, max_new_tokens: int) -> float:
    model.eval()
    enc = tok([r.prompt for r in rows], padding=True, padding_side="left", add_special_tokens=False,
              return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train()
    return sum(spec.reward(t, r) for t, r in zip(texts, rows)) / len(rows)


def run_trl(cfg: RunConfig, base: str, target: float, max_steps: int, eval_every: int) -> dict:
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        raise SystemExit(f"TRL is not installed ({exc}); run: pip install -c constraints/cpu.txt -e .[bench]") from None
    torch.set_num_threads(2)
    spec = get_task(cfg.task.name)
    train_rows, eval_rows = prepare_data(cfg.task)
    eval_rows = eval_rows[: cfg.train.eval_size or len(eval_rows)]
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": r.prompt, "answer": r.answer} for r in train_rows])

    def reward(completions, answer, **_):
        return [spec.reward(c, TaskRow(prompt="", answer=a)) for c, a in zip(completions, answer)]

    class EvalAndStop(TrainerCallback):
        def __init__(self):
            self.eval_s, self.curve = 0.0, []

        def on_step_end(self, args, state, control, model=None, **_):
            if state.global_step % eval_every:
                return
            t = time.perf_counter()
            acc = greedy_accuracy(model, tok, eval_rows, spec, cfg.sampling.max_new_tokens)
            self.eval_s += time.perf_counter() - t
            self.curve.append((state.global_step, round(time.perf_counter() - t0 - self.eval_s, 2), acc))
            print(f"[trl] step {state.global_step}: held-out accuracy {acc:.3f}", flush=True)
            if acc >= target:
                control.should_training_stop = True

    loss = cfg.algo.loss
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"), use_cpu=True, bf16=False, report_to="none",
        save_strategy="no", logging_steps=50, seed=cfg.seed, max_steps=max_steps,
        per_device_train_batch_size=cfg.rollout.prompts_per_step * cfg.sampling.n, num_generations=cfg.sampling.n,
        max_completion_length=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
        learning_rate=cfg.trainer.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=cfg.trainer.betas[0], adam_beta2=cfg.trainer.betas[1], weight_decay=cfg.trainer.weight_decay,
        max_grad_norm=cfg.trainer.max_grad_norm, epsilon=loss.clip_low, epsilon_high=loss.clip_high, beta=0.0,
        loss_type="dapo",  # token-level mean over the batch, as LoongSage's token_mean
        gradient_checkpointing=False)  # its default (on) costs ~20% here (PROBES.md)
    callback = EvalAndStop()
    clock = {"generate_s": 0.0, "step_s": 0.0, "steps": 0}

    @contextlib.contextmanager
    def timed(key: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            clock[key] += time.perf_counter() - t

    class TimedGRPOTrainer(GRPOTrainer):
        """Splits TRL's step into its generation (HF generate, in `_generate_single_turn` in TRL 1.x)
        and the rest, to show where its time goes."""

        def training_step(self, *a, **k):
            clock["steps"] += 1
            with timed("step_s"):
                return super().training_step(*a, **k)

        def _generate_single_turn(self, *a, **k):
            with timed("generate_s"):
                return super()._generate_single_turn(*a, **k)

    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                               processing_class=tok, callbacks=[callback])
    t = time.perf_counter()
    before = greedy_accuracy(model, tok, eval_rows, spec, cfg.sampling.max_new_tokens)
    callback.eval_s += time.perf_counter() - t
    print(f"[trl] held-out accuracy before training: {before:.3f}", flush=True)
    trainer.train()
    n = max(clock["steps"], 1)
    per_step = {"step_s": round(clock["step_s"] / n, 4), "generate_s": None, "train_s": None}
    if clock["generate_s"] > 0:  # 0: this TRL version generates elsewhere; no split then
        per_step.update(generate_s=round(clock["generate_s"] / n, 4),
                        train_s=round((clock["step_s"] - clock["generate_s"]) / n, 4))
    return {"curve": callback.curve, "initial_accuracy": before, "per_step": per_step}


def time_to(curve: list, target: float) -> float | None:
    return next((t for _, t, acc in curve if acc >= target), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/arith_grpo.yaml")
    ap.add_argument("--target", type=float, default=0.40, help="held-out accuracy both must reach")
    ap.add_argument("--max-steps", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    run_dir = tempfile.mkdtemp(prefix="bench-loongsage-")
    cfg = load_config(args.recipe, [
        f"run_dir={run_dir}", "rollout.max_staleness=1", f"train.steps={args.max_steps}",
        f"train.eval_every={args.eval_every}", "train.max_minutes=null", f"train.target_accuracy={args.target}",
        "trainer.threads=1", "rollout.engine_threads=1", "trainer.cpu_affinity=[0]", "engine.cpu_affinity=[1]",
        "train.controller_cpu_affinity=[1]", *args.overrides])
    base = str(asyncio.run(ensure_base_policy(cfg, Console())))  # shared, cached, not timed
    out: dict = {"target_accuracy": args.target}
    ls = run_loongsage(cfg)
    print(f"loongsage: {json.dumps(ls['curve'])}", flush=True)
    tr = run_trl(cfg, base, args.target, args.max_steps, args.eval_every)
    print(f"trl: {json.dumps(tr['curve'])}", flush=True)
    out["loongsage_s"], out["trl_s"] = time_to(ls["curve"], args.target), time_to(tr["curve"], args.target)
    out["loongsage_steps"] = next((s for s, _, a in ls["curve"] if a >= args.target), None)
    out["trl_steps"] = next((s for s, _, a in tr["curve"] if a >= args.target), None)
    out["ratio"] = round(out["trl_s"] / out["loongsage_s"], 3) if out["loongsage_s"] and out["trl_s"] else None
    print(f"{'':10s} {'seconds':>8s} {'steps':>6s}")
    for name in ("loongsage", "trl"):
        print(f"{name:10s} {out[f'{name}_s'] or float('nan'):8.1f} {out[f'{name}_steps'] or 0:6d}")
    print(f"TRL / LoongSage wall clock to {args.target:.2f}: {out['ratio']}x")
    out["loongsage_per_step"], out["trl_per_step"] = ls["per_step"], tr["per_step"]
    print(f"per step (s): LoongSage {ls['per_step']} (async: generate and train overlap); TRL {tr['per_step']} "
          "(one process: generate, then the rest of the step)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
