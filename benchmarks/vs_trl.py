"""Wall clock to the same held-out accuracy: LoongSage vs TRL's GRPOTrainer on CPU, from the same
bootstrapped base model, with the same group size, prompts per step, max new tokens, learning rate,
clip range and grad clip, evaluated on the same held-out rows with the same decoding.

    pip install -c constraints/cpu.txt -e .[bench]     # TRL is an extra, only for this benchmark
    python benchmarks/vs_trl.py --workload short|long [--seeds 0,1,2] [--target T] [--max-steps N]
                                [--eval-every N] [overrides ...]

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

How it is timed. Each framework runs in a process of its own, started fresh for each seed, and its
clock starts when that process starts: what a user waits for from the command, the imports included
(TRL's torch, transformers, trl and datasets take ~10 s here; LoongSage's controller ~5 s, and its
trainer and engine processes import torch and transformers again during its start-up). Every held-out
evaluation is left out of both clocks. The point compared is the first evaluation at or above the
target (`long`: the one after its steps). Both sample with a seed per run (TRL's `seed`; LoongSage's
`seed` and `rollout.seeded_sampling`) from the same base model, so a run repeats, yet the step at
which a seed first reaches the target still varies by tens of steps: `short` runs three seeds and
compares the medians. The last line is one JSON object: {"workload", "target_accuracy", "seeds",
"loongsage_schedule", "loongsage_s", "trl_s", "ratio", "ratio_after_imports", "loongsage_accuracy",
"trl_accuracy", "loongsage_steps", "trl_steps", ..., "loongsage_per_step", "trl_per_step", "runs"}
with ratio = trl_s / loongsage_s (medians over the seeds); `ratio_after_imports` starts both clocks
after each process's own imports instead; the per-step objects split a step into generation and
training (seconds); `runs` holds each seed's numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

# Nothing heavy at module level: a framework's process imports what it uses inside its own clock.


def run_loongsage(cfg, spawned_at: float) -> dict:
    """`spawned_at`: when this process started (time.time()); the curve's seconds count from it."""
    import asyncio

    from loongsage.controller.train import train
    from loongsage.metrics import read_metrics

    lead = time.time() - spawned_at  # the interpreter, the controller's imports, the config
    asyncio.run(train(cfg))
    curve, eval_s, steps = [], 0.0, []
    for r in read_metrics(cfg.run_dir):
        eval_s += r.get("time/eval_s", 0.0)
        if "eval/accuracy" in r:
            curve.append((r["step"], round(lead + r["time/elapsed_s"] - eval_s, 2), r["eval/accuracy"]))
        if r["step"] > 0 and "time/train_s" in r:
            steps.append(r)
    n = max(len(steps), 1)
    per_step = {"step_s": round(sum(r["time/step_s"] - r.get("time/eval_s", 0.0) for r in steps) / n, 4),
                **{k: round(sum(r[f"time/{k}"] for r in steps) / n, 4) for k in ("generate_s", "train_s")}}
    return {"curve": curve, "per_step": per_step, "imports_s": round(lead, 2)}


def held_out_accuracy(model, tok, rows: list, spec, max_new_tokens: int, temperature: float) -> float:
    """The recipe's evaluation in TRL's process: greedy, or one sample per row at `temperature`."""
    import torch

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


def run_trl(cfg, base: str, target: float | None, max_steps: int, eval_every: int, spawned_at: float) -> dict:
    """`spawned_at`: when this process started (time.time()); the curve's seconds count from it."""
    import contextlib

    import torch

    from loongsage.tasks.base import TaskRow, get_task
    from loongsage.tasks.prepare import prepare_data

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
    lead = time.time() - spawned_at  # the interpreter, torch, transformers, trl, datasets, the data
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
            self.curve.append((state.global_step, round(lead + time.perf_counter() - t0 - self.eval_s, 2), acc))
            print(f"[trl] step {state.global_step}: held-out accuracy {acc:.3f}", flush=True)
            if target is not None and acc >= target:
                control.should_training_stop = True

    loss = cfg.algo.loss
    args = GRPOConfig(
        output_dir=f"{cfg.run_dir}/trl", use_cpu=True, bf16=False, report_to="none",
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
    return {"curve": callback.curve, "initial_accuracy": before, "per_step": per_step, "imports_s": round(lead, 2)}


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
              "seeds": [0, 1, 2],
              "schedule": ["rollout.max_staleness=0", "trainer.threads=2", "rollout.engine_threads=2",
                           "trainer.cpu_affinity=null", "engine.cpu_affinity=null",
                           "train.controller_cpu_affinity=null", "rollout.coalesce_prompts=64",
                           "rollout.seeded_sampling=true"]},
    # RL moves this task's held-out accuracy only a little at this model size (sampled accuracy
    # 0.31 -> ~0.37 in 150 steps), within reach of evaluation noise: the two frameworks are compared
    # on equal work (60 steps) instead, each reporting its accuracy after them.
    "long": {"recipe": "recipes/count_grpo.yaml", "target": None, "max_steps": 60, "eval_every": 60, "seeds": [0],
             "schedule": ["rollout.max_staleness=1", "trainer.threads=1", "rollout.engine_threads=1",
                          "trainer.cpu_affinity=[0]", "engine.cpu_affinity=[1]",
                          "train.controller_cpu_affinity=[1]", "rollout.coalesce_prompts=64",
                          "rollout.seeded_sampling=true"]},
}


def run_overrides(work: dict, max_steps: int, eval_every: int, target: float | None, overrides: list[str]) -> list[str]:
    """The run config of both frameworks: the recipe, the steps and evaluations, LoongSage's schedule
    for the workload, then the user's overrides."""
    return [f"train.steps={max_steps}", f"train.eval_every={eval_every}", "train.max_minutes=null",
            *([f"train.target_accuracy={target}"] if target is not None else []), *work["schedule"], *overrides]


def seeded_overrides(base: str, seed: int) -> list[str]:
    """One seed's run: the shared base model as is (its bootstrap is keyed by the recipe's seed,
    and every seed starts from the same one), the RL run's seed changed."""
    return [f"model.path={base}", "bootstrap.enabled=false", f"seed={seed}"]


def median_of(values: list):
    kept = [v for v in values if v is not None]
    return round(statistics.median(kept), 3) if kept and len(kept) == len(values) else None


def summarize(workload: str, target: float | None, max_steps: int, schedule: str, runs: list[dict]) -> dict:
    """Medians over the seeds of each framework's point (seconds, steps, accuracy) and per-step split;
    a framework that missed the target on any seed has no median (and the ratio is None)."""
    out: dict = {"workload": workload, "target_accuracy": target, "seeds": [r["seed"] for r in runs],
                 "loongsage_schedule": schedule}
    reach = {name: [reached(r[name]["curve"], target, max_steps) for r in runs] for name in ("loongsage", "trl")}
    for name in ("loongsage", "trl"):
        points = [p or (None, None, None) for p in reach[name]]
        out[f"{name}_s"] = median_of([p[1] for p in points])
        out[f"{name}_steps"] = median_of([p[0] for p in points])
        out[f"{name}_accuracy"] = median_of([p[2] for p in points])
        after = [None if p[1] is None else p[1] - r[name]["imports_s"] for p, r in zip(points, runs)]
        out[f"{name}_after_imports_s"] = median_of(after)
        out[f"{name}_imports_s"] = median_of([r[name]["imports_s"] for r in runs])
    for key, num, den in (("ratio", "trl_s", "loongsage_s"),
                          ("ratio_after_imports", "trl_after_imports_s", "loongsage_after_imports_s")):
        out[key] = round(out[num] / out[den], 3) if out[num] and out[den] else None
    for name in ("loongsage", "trl"):
        steps = [r[name]["per_step"] for r in runs]
        out[f"{name}_per_step"] = {k: median_of([s[k] for s in steps]) for k in steps[0]}
    out["runs"] = [{"seed": r["seed"], **{f"{n}_point": reach[n][i] for n in ("loongsage", "trl")},
                    **{f"{n}_imports_s": r[n]["imports_s"] for n in ("loongsage", "trl")}} for i, r in enumerate(runs)]
    return out


def child_run(framework: str, argv: list[str], seed: int, base: str) -> dict:
    """One framework's run for one seed in a fresh process, timed from the moment it is started."""
    cmd = [sys.executable, __file__, *argv, "--child", framework, "--seed", str(seed), "--base", base,
           "--spawned-at", repr(time.time())]
    result = None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as proc:
        for line in proc.stdout:  # its progress, as it goes
            if line.startswith("RESULT "):
                result = json.loads(line.removeprefix("RESULT "))
            else:
                sys.stdout.write(f"  [{framework} {seed}] {line}")
    if proc.returncode or result is None:
        raise SystemExit(f"the {framework} run of seed {seed} failed (exit {proc.returncode})")
    return result


def without_option(argv: list[str], name: str) -> list[str]:
    """`argv` less `name VALUE` and `name=VALUE`."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="short")
    ap.add_argument("--recipe", help="default: the workload's recipe")
    ap.add_argument("--target", type=float, help="held-out accuracy both must reach (default: the workload's; "
                    "none: equal work, --max-steps steps each)")
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--eval-every", type=int)
    ap.add_argument("--seeds", help="comma-separated RL seeds (default: the workload's)")
    ap.add_argument("--child", choices=["loongsage", "trl"], help=argparse.SUPPRESS)  # one run, in its own process
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--base", help=argparse.SUPPRESS)
    ap.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="recipe overrides, applied after the workload's schedule")
    args = ap.parse_args()
    work = WORKLOADS[args.workload]
    recipe = args.recipe or work["recipe"]
    target = work["target"] if args.target is None else args.target
    max_steps, eval_every = args.max_steps or work["max_steps"], args.eval_every or work["eval_every"]
    common = run_overrides(work, max_steps, eval_every, target, args.overrides)

    from loongsage.config import load_config

    if args.child:  # its run folder (LoongSage's run directory, TRL's output) goes when it ends
        with tempfile.TemporaryDirectory(prefix=f"bench-{args.child}-") as run_dir:
            cfg = load_config(recipe, [f"run_dir={run_dir}", *common, *seeded_overrides(args.base, args.seed)])
            result = (run_loongsage(cfg, args.spawned_at) if args.child == "loongsage"
                      else run_trl(cfg, args.base, target, max_steps, eval_every, args.spawned_at))
        print("RESULT " + json.dumps(result), flush=True)
        return

    import asyncio

    from rich.console import Console

    from loongsage.controller.bootstrap import ensure_base_policy

    cfg = load_config(recipe, common)
    base = str(asyncio.run(ensure_base_policy(cfg, Console())))  # shared, cached, not timed
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else work["seeds"]
    argv = without_option(sys.argv[1:], "--seeds")
    runs = []
    for seed in seeds:
        run = {"seed": seed}
        for framework in ("loongsage", "trl"):
            run[framework] = child_run(framework, argv, seed, base)
            print(f"seed {seed} {framework} (imports {run[framework]['imports_s']} s): "
                  f"{json.dumps(run[framework]['curve'])}", flush=True)
        runs.append(run)
    out = summarize(args.workload, target, max_steps, "async k=1" if cfg.rollout.max_staleness else "sync", runs)
    goal = f"wall clock to {target:.2f}" if target is not None else f"wall clock for {max_steps} steps"
    print(f"medians over seeds {seeds}, each framework timed from its process's start:")
    print(f"{'':10s} {'seconds':>8s} {'imports':>8s} {'steps':>6s} {'accuracy':>8s}")
    for name in ("loongsage", "trl"):
        print(f"{name:10s} {out[f'{name}_s'] or float('nan'):8.1f} {out[f'{name}_imports_s'] or float('nan'):8.1f} "
              f"{out[f'{name}_steps'] or 0:6.0f} {out[f'{name}_accuracy'] or float('nan'):8.3f}")
    print(f"TRL / LoongSage {goal}: {out['ratio']}x (clocks started after each one's imports: "
          f"{out['ratio_after_imports']}x)")
    print(f"per step (s): LoongSage {out['loongsage_per_step']} ({out['loongsage_schedule']}); TRL "
          f"{out['trl_per_step']} (one process: generate, then the rest of the step)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
