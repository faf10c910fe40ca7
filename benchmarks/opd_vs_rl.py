"""On-policy distillation vs RL from the same base policy, side by side in one run: wall clock to the
same held-out accuracy.

1. RL (GRPO, the arith recipe) from the base policy until the teacher's accuracy; on the way it passes
   the target, and its time to the target is RL's.
2. OPD: the same base policy distils from that RL-trained policy as its teacher (pure distillation,
   full-vocabulary forward KL on its own samples, the same prompts and sampling), until the target.

    python benchmarks/opd_vs_rl.py [--target 0.38] [--teacher-accuracy 0.45] [recipe overrides ...]

Both runs include their start-up (Ray, engines; OPD's teacher engine too). Last line, one JSON object:
{"target_accuracy", "rl_s", "opd_s", "rl_steps", "opd_steps", "teacher_accuracy", "ratio": rl_s / opd_s}
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


def time_to(run_dir: str, target: float) -> tuple[float | None, int | None]:
    """(seconds, step) of the first held-out evaluation at or above `target`."""
    for r in read_metrics(run_dir):
        if r.get("eval/accuracy", -1) >= target and r["step"] > 0:
            return r["time/elapsed_s"], r["step"]
    return None, None


def opd_config(recipe: str, common: list[str], run_dir: str, target: float, teacher: str):
    """The OPD run: the recipe's base policy and data, pure distillation from `teacher` (a model folder)."""
    return load_config(recipe, common + [
        f"run_dir={run_dir}", f"train.target_accuracy={target}", "algo.loss.is_mode=none",
        "algo.loss.distill.gkd_coef=1.0", "algo.loss.distill.gkd_signal=full_fkl", "trainer.lr=5e-4",
        f"teachers=[{{name: rl_teacher, model: {teacher}}}]"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/arith_grpo.yaml")
    ap.add_argument("--target", type=float, default=0.38, help="held-out accuracy both must reach")
    ap.add_argument("--teacher-accuracy", type=float, default=0.45, help="RL runs on to this: the teacher")
    ap.add_argument("--max-steps", type=int, default=800)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.teacher_accuracy <= args.target:
        raise SystemExit("--teacher-accuracy must be above --target (the student distils towards the teacher)")
    common = [f"train.steps={args.max_steps}", f"train.eval_every={args.eval_every}", "train.max_minutes=30",
              "rollout.max_staleness=1", "rollout.engine_threads=1", "trainer.threads=1", *args.overrides]
    rl_dir = tempfile.mkdtemp(prefix="bench-rl-")
    asyncio.run(train(load_config(args.recipe, common + [f"run_dir={rl_dir}",
                                                         f"train.target_accuracy={args.teacher_accuracy}"])))
    teacher = str(Path(rl_dir) / "checkpoints" / "final")
    teacher_acc = [r["eval/accuracy"] for r in read_metrics(rl_dir) if "eval/accuracy" in r][-1]
    rl_s, rl_steps = time_to(rl_dir, args.target)
    opd_dir = tempfile.mkdtemp(prefix="bench-opd-")
    asyncio.run(train(opd_config(args.recipe, common, opd_dir, args.target, teacher)))
    opd_s, opd_steps = time_to(opd_dir, args.target)
    print(f"{'':10}{'seconds':>10}{'steps':>8}")
    print(f"{'RL':10}{rl_s or float('nan'):>10.1f}{rl_steps or 0:>8}")
    print(f"{'OPD':10}{opd_s or float('nan'):>10.1f}{opd_steps or 0:>8}   (teacher at {teacher_acc:.3f})")
    ratio = round(rl_s / opd_s, 3) if rl_s and opd_s else None
    print(json.dumps({"target_accuracy": args.target, "rl_s": rl_s and round(rl_s, 2), "opd_s": opd_s and round(opd_s, 2),
                      "rl_steps": rl_steps, "opd_steps": opd_steps, "teacher_accuracy": teacher_acc, "ratio": ratio}))


if __name__ == "__main__":
    main()
