"""Sync (k = 0) vs async (k = 1, 2) on the same recipe and the same number of trained samples,
side by side in one run. Engine and trainer get one torch thread each; the trainer is pinned to
core 0, the engine, this process (the controller: HTTP to the engine, batching) and Ray's own
processes to core 1 (`--no-pin` lets the OS schedule them). The workload is one where generation and training take
similar time: each mode reports its per-step `generate_s` and `train_s`.

    python benchmarks/async_vs_sync.py [--steps 150] [--seeds 3] [recipe overrides ...]

Every mode starts from the same base policy (the recipe's bootstrap, built once) and runs once per
seed (prompt order and sampling); held-out accuracy is reported per seed and as the mean.
Prints a table, then one JSON object as the last line:
{"sync": {...}, "async_k1": {...}, "async_k2": {...}, "ratio": async_k1 samples/s over sync,
 "accuracy_gap_k1": sync mean final accuracy - async_k1's}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile

from loongsage.config import load_config
from loongsage.controller.bootstrap import ensure_base_policy
from loongsage.controller.train import train
from loongsage.metrics import read_metrics

MODES = {"sync": 0, "async_k1": 1, "async_k2": 2}


def measure(run_dir: str) -> dict:
    recs = [r for r in read_metrics(run_dir) if r["step"] > 0 and "time/step_s" in r]
    wall = sum(r["time/step_s"] - r.get("time/eval_s", 0.0) for r in recs)  # training, not evaluation
    trained = sum(r["samples/trained"] for r in recs)
    evals = [r["eval/accuracy"] for r in read_metrics(run_dir) if "eval/accuracy" in r]
    steady = recs[len(recs) // 5:]  # skip the warm-up steps
    return {
        "samples_per_s": round(trained / wall, 2),
        "trained_samples": trained,
        "train_busy_frac": round(sum(r["time/train_busy_frac"] for r in steady) / len(steady), 3),
        "generate_busy_frac": round(sum(r["time/generate_busy_frac"] for r in steady) / len(steady), 3),
        "max_staleness": max(r["staleness/max"] for r in recs),
        "dropped_stale": sum(r["samples/dropped_stale"] for r in recs),
        "step_s": round(wall / len(recs), 3),
        "generate_s": round(sum(r["time/generate_s"] for r in steady) / len(steady), 3),
        "train_s": round(sum(r["time/train_s"] for r in steady) / len(steady), 3),
        "initial_accuracy": evals[0],
        "final_accuracy": evals[-1],
    }


def mean_over_seeds(runs: list[dict]) -> dict:
    """Each numeric field averaged over the seeds; the accuracies also listed per seed."""
    out = {k: round(sum(r[k] for r in runs) / len(runs), 3) for k in runs[0]}
    out["final_accuracy_per_seed"] = [r["final_accuracy"] for r in runs]
    out["max_staleness"] = max(r["max_staleness"] for r in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/arith_grpo.yaml")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--no-pin", action="store_true", help="do not pin trainer and engine to their own cores")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not args.no_pin:  # before Ray starts: Ray's own processes share the engine's core, not the trainer's
        os.sched_setaffinity(0, {1})
    base = asyncio.run(ensure_base_policy(load_config(args.recipe, args.overrides)))
    out = {}
    for name in args.modes.split(","):
        runs = []
        for seed in range(args.seeds):
            run_dir = tempfile.mkdtemp(prefix=f"bench-{name}-s{seed}-")
            cfg = load_config(args.recipe, [
                f"run_dir={run_dir}", f"rollout.max_staleness={MODES[name]}", f"train.steps={args.steps}",
                f"train.eval_every={args.steps}", "train.max_minutes=null", "trainer.threads=1",
                "rollout.engine_threads=1", "rollout.dynamic_sampling=false", f"seed={seed}",
                f"model.path={base}", "bootstrap.enabled=false",
                *([] if args.no_pin else ["trainer.cpu_affinity=[0]", "engine.cpu_affinity=[1]",
                                          "train.controller_cpu_affinity=[1]"]), *args.overrides])
            asyncio.run(train(cfg))
            runs.append(measure(run_dir))
            print(f"{name} seed {seed}: {json.dumps(runs[-1])}", flush=True)
        out[name] = mean_over_seeds(runs)
    print(f"{'mode':10s} {'samples/s':>10s} {'train busy':>11s} {'gen busy':>9s} {'max stale':>10s} "
          f"{'final acc (mean)':>17s}  per seed")
    for name, m in out.items():
        print(f"{name:10s} {m['samples_per_s']:10.1f} {m['train_busy_frac']:11.2f} {m['generate_busy_frac']:9.2f} "
              f"{m['max_staleness']:10.0f} {m['final_accuracy']:17.3f}  {m['final_accuracy_per_seed']}")
    if "sync" in out and "async_k1" in out:
        out["ratio"] = round(out["async_k1"]["samples_per_s"] / out["sync"]["samples_per_s"], 3)
        out["accuracy_gap_k1"] = round(out["sync"]["final_accuracy"] - out["async_k1"]["final_accuracy"], 3)
        print(f"async k=1 / sync throughput: {out['ratio']:.2f}x; accuracy gap (sync - async k=1): "
              f"{out['accuracy_gap_k1']:+.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
