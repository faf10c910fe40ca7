"""On-policy distillation vs RL from the same base policy, side by side in one run: wall clock to the
same held-out accuracy.

1. RL (GRPO, the arith recipe) from the base policy for `--rl-steps`; its final policy is the
   teacher, and its time to the target on the way is RL's.
2. OPD: the same base policy distils from that RL-trained policy as its teacher (pure distillation,
   full-vocabulary forward KL on its own samples, the same prompts, sampling and lr as RL: 5e-4, right
   for a student far from its teacher as in recipes/multi_teacher_opd.yaml, only shook this one, a
   few RL steps from its teacher, around 0.18-0.36 for 800 steps), for `--opd-steps`.

A run reaches the target when the mean of its last `--window` held-out evaluations does: one
evaluation of this policy moves by up to +-0.08 from the next (RL "reached" 0.38 at step 10 by a
single lucky one), so the first single crossing timed the noise, not the learning.

    python benchmarks/opd_vs_rl.py [--target 0.36] [--rl-steps 500] [--opd-steps 300] [recipe overrides ...]

Both runs include their start-up (Ray, engines; OPD's teacher engine too). Last line, one JSON object:
{"target_accuracy", "window", "rl_s", "opd_s", "rl_steps", "opd_steps", "teacher_accuracy", "ratio": rl_s / opd_s}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from loongsage.config import load_config
from loongsage.controller.train import train
from loongsage.metrics import read_metrics


def evals(run_dir: str) -> list[dict]:
    """The held-out evaluations after training began (the base policy's own, step 0, never counts)."""
    return [r for r in read_metrics(run_dir) if "eval/accuracy" in r and r["step"] > 0]


def time_to(run_dir: str, target: float, window: int = 3) -> tuple[float | None, int | None]:
    """(seconds, step) of the first evaluation at which the mean of the last `window` is >= `target`."""
    done = evals(run_dir)
    for i in range(window - 1, len(done)):
        if sum(r["eval/accuracy"] for r in done[i - window + 1:i + 1]) / window >= target:
            return done[i]["time/elapsed_s"], done[i]["step"]
    return None, None


def opd_config(recipe: str, common: list[str], run_dir: str, teacher: str):
    """The OPD run: the recipe's base policy and data, pure distillation from `teacher` (a model folder)."""
    return load_config(recipe, common + [
        f"run_dir={run_dir}", "algo.loss.is_mode=none",
        "algo.loss.distill.gkd_coef=1.0", "algo.loss.distill.gkd_signal=full_fkl", "trainer.lr=1e-4",
        f"teachers=[{{name: rl_teacher, model: {teacher}}}]"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/arith_grpo.yaml")
    ap.add_argument("--target", type=float, default=0.36, help="held-out accuracy both must reach")
    ap.add_argument("--rl-steps", type=int, default=500, help="RL steps; the final policy is the teacher")
    ap.add_argument("--opd-steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--window", type=int, default=3, help="evaluations averaged to decide the target is reached")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    common = [f"train.eval_every={args.eval_every}", "train.max_minutes=30", "rollout.max_staleness=1",
              "rollout.engine_threads=1", "trainer.threads=1", *args.overrides]
    rl_dir = tempfile.mkdtemp(prefix="bench-rl-")
    asyncio.run(train(load_config(args.recipe, common + [f"run_dir={rl_dir}", f"train.steps={args.rl_steps}"])))
    teacher = str(Path(rl_dir) / "checkpoints" / "final")
    teacher_acc = sum(r["eval/accuracy"] for r in evals(rl_dir)[-args.window:]) / args.window
    if teacher_acc <= args.target:
        raise SystemExit(f"the RL teacher ends at {teacher_acc:.3f}, not above --target {args.target}: more --rl-steps")
    rl_s, rl_steps = time_to(rl_dir, args.target, args.window)
    opd_dir = tempfile.mkdtemp(prefix="bench-opd-")
    asyncio.run(train(opd_config(args.recipe, common + [f"train.steps={args.opd_steps}"], opd_dir, teacher)))
    opd_s, opd_steps = time_to(opd_dir, args.target, args.window)
    print(f"{'':10}{'seconds':>10}{'steps':>8}")
    print(f"{'RL':10}{rl_s or float('nan'):>10.1f}{rl_steps or 0:>8}")
    print(f"{'OPD':10}{opd_s or float('nan'):>10.1f}{opd_steps or 0:>8}   (teacher at {teacher_acc:.3f})")
    ratio = round(rl_s / opd_s, 3) if rl_s and opd_s else None
    print(json.dumps({"target_accuracy": args.target, "window": args.window, "rl_s": rl_s and round(rl_s, 2),
                      "opd_s": opd_s and round(opd_s, 2), "rl_steps": rl_steps, "opd_steps": opd_steps,
                      "teacher_accuracy": round(teacher_acc, 3), "ratio": ratio}))


if __name__ == "__main__":
    main()
