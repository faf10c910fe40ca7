"""Wall clock to the same held-out accuracy: LoongSage vs TRL's GRPOTrainer on CPU, from the same
bootstrapped base model, with the same group size, prompts per step, max new tokens, learning rate,
clip range and grad clip, evaluated on the same held-out rows with the same decoding.

    pip install -c constraints/cpu.txt -e .[bench]     # TRL is an extra, only for this benchmark
    python benchmarks/vs_trl.py --workload short|long [--target T] [--max-steps N] [--eval-every N] [overrides ...]

Workloads (`WORKLOADS`): `short` is the main job's arith recipe (answers of 3-4 tokens, where a step
costs per request, not per token); `long` is `recipes/count_grpo.yaml` (outputs from 2 to 128 tokens
in one batch, where a step's time is its generation's long tail). Each framework uses both cores
its own best way. TRL runs in one process with 2 torch threads. LoongSage, measured per workload:
- short: synchronous and colocated, trainer and engine each with 2 threads, taking turns. Its trainer
  on one thread takes longer (0.23 s) than a whole synchronous step with two (0.20 s), so pinning the
  trainer and the engine to a core each for async overlap (k = 1) loses here (0.28 s a step). A
  step's 32 group requests go out as one batched request (`rollout.coalesce_prompts`): a step
  0.315 -> 0.282 s in the same session (2026-12-07).
- long: async k = 1, trainer pinned to core 0, engine and controller to core 1: generation and
  training take similar time (about 1 s each a step), so overlapping them nearly halves a step.
  Coalesced requests here too: a step 1.405 -> 1.355 s in the same session (2026-12-07).
Times start at each framework's entry point (start-up included: Ray and engines, or model load and
trainer set-up), exclude the shared bootstrap and every evaluation, and stop at the first evaluation
at or above the target (`long`: after its steps). The last line is one JSON object:
{"workload", "target_accuracy", "loongsage_schedule", "loongsage_s", "trl_s", "ratio",
 "loongsage_accuracy", "trl_accuracy", ..., "loongsage_per_step", "trl_per_step"} with
ratio = trl_s / loongsage_s; the per-step objects split a step into generation and training
(seconds), which shows where each framework's time goes.
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


def held_out_accuracy(model, tok, rows: list[TaskRow], spec, max_new_tokens: int, temperature: float) -> float:
    """The recipe's evaluation in TRL's process: greedy, or one sample per row at `temperature`."""
    model.eval()
    enc = tok([r.prompt for r in rows], padding=True, padding_side="left", add_special_tokens=False,
              return_tensors="pt")
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(**enc, **sampling, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train()
    return sum(spec.reward(t, r) for t, r in zip(texts, rows)) / len(rows)


def run_trl(cfg: RunConfig, base: str, target: float | None, max_steps: int, eval_every: int) -> dict:
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
            acc = held_out_accuracy(model, tok, eval_rows, spec, cfg.sampling.max_new_tokens,
                                    cfg.train.eval_temperature)
            self.eval_s += time.perf_counter() - t
            self.curve.append((state.global_step, round(time.perf_counter() - t0 - self.eval_s, 2), acc))
            print(f"[trl] step {state.global_step}: held-out accuracy {acc:.3f}", flush=True)
            if target is not None and acc >= target:
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
    before = held_out_accuracy(model, tok, eval_rows, spec, cfg.sampling.max_new_tokens, cfg.train.eval_temperature)
    callback.eval_s += time.perf_counter() - t
    print(f"[trl] held-out accuracy before training: {before:.3f}", flush=True)
    trainer.train()
    n = max(clock["steps"], 1)
    per_step = {"step_s": round(clock["step_s"] / n, 4), "generate_s": None, "train_s": None}
    if clock["generate_s"] > 0:  # 0: this TRL version generates elsewhere; no split then
        per_step.update(generate_s=round(clock["generate_s"] / n, 4),
                        train_s=round((clock["step_s"] - clock["generate_s"]) / n, 4))
    return {"curve": callback.curve, "initial_accuracy": before, "per_step": per_step}


def reached(curve: list, target: float | None, max_steps: int) -> tuple | None:
    """The first evaluation at or above `target` (step, seconds, accuracy); with no target, the one
    after `max_steps` (equal work: the same steps, samples and settings in both frameworks)."""
    if target is None:
        return next((point for point in curve if point[0] == max_steps), None)
    return next((point for point in curve if point[2] >= target), None)


# Each workload: its recipe, the held-out target both frameworks must reach, and how LoongSage uses
# the two cores there (chosen from measurements; see the module docstring).
WORKLOADS = {
    "short": {"recipe": "recipes/arith_grpo.yaml", "target": 0.40, "max_steps": 400, "eval_every": 10,
              "schedule": ["rollout.max_staleness=0", "trainer.threads=2", "rollout.engine_threads=2",
                           "trainer.cpu_affinity=null", "engine.cpu_affinity=null",
                           "train.controller_cpu_affinity=null", "rollout.coalesce_prompts=64"]},
    # RL moves this task's held-out accuracy only a little at this model size (sampled accuracy
    # 0.31 -> ~0.37 in 150 steps), within reach of evaluation noise: the two frameworks are compared
    # on equal work (60 steps) instead, each reporting its accuracy after them.
    "long": {"recipe": "recipes/count_grpo.yaml", "target": None, "max_steps": 60, "eval_every": 60,
             "schedule": ["rollout.max_staleness=1", "trainer.threads=1", "rollout.engine_threads=1",
                          "trainer.cpu_affinity=[0]", "engine.cpu_affinity=[1]",
                          "train.controller_cpu_affinity=[1]", "rollout.coalesce_prompts=64"]},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="short")
    ap.add_argument("--recipe", help="default: the workload's recipe")
    ap.add_argument("--target", type=float, help="held-out accuracy both must reach (default: the workload's; "
                    "none: equal work, --max-steps steps each)")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("overrides", nargs="*", help="recipe overrides, applied after the workload's schedule")
    args = ap.parse_args()
    work = WORKLOADS[args.workload]
    recipe = args.recipe or work["recipe"]
    target = work["target"] if args.target is None else args.target
    max_steps, eval_every = args.max_steps or work["max_steps"], args.eval_every or work["eval_every"]
    run_dir = tempfile.mkdtemp(prefix="bench-loongsage-")
    cfg = load_config(recipe, [
        f"run_dir={run_dir}", f"train.steps={max_steps}", f"train.eval_every={eval_every}", "train.max_minutes=null",
        *([f"train.target_accuracy={target}"] if target is not None else []), *work["schedule"], *args.overrides])
    base = str(asyncio.run(ensure_base_policy(cfg, Console())))  # shared, cached, not timed
    out: dict = {"workload": args.workload, "target_accuracy": target,
                 "loongsage_schedule": "async k=1" if cfg.rollout.max_staleness else "sync"}
    ls = run_loongsage(cfg)
    print(f"loongsage: {json.dumps(ls['curve'])}", flush=True)
    tr = run_trl(cfg, base, target, max_steps, eval_every)
    print(f"trl: {json.dumps(tr['curve'])}", flush=True)
    goal = f"wall clock to {target:.2f}" if target is not None else f"wall clock for {max_steps} steps"
    for name, curve in (("loongsage", ls["curve"]), ("trl", tr["curve"])):
        step, seconds, accuracy = reached(curve, target, max_steps) or (None, None, None)
        out.update({f"{name}_s": seconds, f"{name}_steps": step, f"{name}_accuracy": accuracy})
    out["ratio"] = round(out["trl_s"] / out["loongsage_s"], 3) if out["loongsage_s"] and out["trl_s"] else None
    print(f"{'':10s} {'seconds':>8s} {'steps':>6s} {'accuracy':>8s}")
    for name in ("loongsage", "trl"):
        print(f"{name:10s} {out[f'{name}_s'] or float('nan'):8.1f} {out[f'{name}_steps'] or 0:6d} "
              f"{out[f'{name}_accuracy'] or float('nan'):8.3f}")
    print(f"TRL / LoongSage {goal}: {out['ratio']}x")
    out["loongsage_per_step"], out["trl_per_step"] = ls["per_step"], tr["per_step"]
    print(f"per step (s): LoongSage {ls['per_step']} ({out['loongsage_schedule']}); TRL {tr['per_step']} "
          "(one process: generate, then the rest of the step)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
