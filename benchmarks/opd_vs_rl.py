"""On-policy distillation vs RL from the same base policy, side by side in one run: wall clock to the
same held-out accuracy.

1. RL (GRPO, the arith recipe) from the base policy for `--rl-steps`; its final policy is the
   teacher, and its time to the target on the way is RL's.
2. OPD: the same base policy distils from that RL-trained policy as its teacher for `--opd-steps`:
   pure distillation (`--opd-role gkd`), the forward KL over the teacher's top-16 tokens plus the
   tail on the student's own samples, lr 3e-4, the same 256 samples a step as RL but one per prompt
   over 256 prompts (OPD needs no group baseline; more prompts a step cut the steps it needs:
   2026-12-07, docs/distillation.md), two optimizer steps a batch (`--opd-mini-batches`: the
   teacher's dense signal stands a second step on the same samples, and pure distillation needs no
   proximal pass for it). `--opd-role pg` is the other role: RL's objective with the
   advantage shaped by the teacher, A_t - coef * d_t (`--opd-signal k1`: the reverse KL, signed).

Both runs coalesce the generate calls made together into batched requests (`rollout.coalesce_prompts`:
arith's answers are a few tokens, so nobody waits on a long one).

The teacher must be well above the target (it is what OPD is for: a strong teacher the student is
far from): 1000 RL steps take this policy from ~0.3 to ~0.6, the target is 0.50. With a teacher a
few points above the student (500 RL steps, target 0.36) OPD is slower than RL (ratio 0.38 on
2026-12-05, docs/distillation.md). Sampled-token signals (`--opd-signal k2`) are cheaper per step
but collapse this student at lr 3e-4 (the RL-sharpened teacher gives the student's own samples
logprobs several nats below the student's).

A run reaches the target when the mean of its last `--window` held-out evaluations does: one
evaluation of this policy moves by up to +-0.08 from the next (RL "reached" 0.38 at step 10 by a
single lucky one), so the first single crossing timed the noise, not the learning.

    python benchmarks/opd_vs_rl.py [--target 0.50] [--rl-steps 1000] [--opd-steps 200] [--opd-lr 3e-4]
                                   [--opd-n 1] [--opd-prompts 256] [--opd-mini-batches 2] [--opd-signal topk_fkl]
                                   [--opd-role gkd]
                                   [--rl-run DIR] [overrides of both runs ...]

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


def common_overrides(eval_every: int, overrides: list[str]) -> list[str]:
    """Both runs: async k = 1 with a core each, and generate calls made together sent as batches."""
    return [f"train.eval_every={eval_every}", "train.max_minutes=30", "rollout.max_staleness=1",
            "rollout.engine_threads=1", "trainer.threads=1", "rollout.coalesce_prompts=64", *overrides]


def opd_config(recipe: str, common: list[str], run_dir: str, teacher: str, lr: float = 3e-4,
               signal: str = "topk_fkl", role: str = "gkd", coef: float = 1.0, n: int = 1, prompts: int = 256,
               mini_batches: int = 2, overrides: tuple = ()):
    """The OPD run: the recipe's base policy and data, distilling from `teacher` (a model folder).
    gkd: the divergence as the loss (coef 1: pure distillation, no task reward); pg: the recipe's RL
    objective with the advantage shaped per token, A_t - coef * d_t (`signal` k1: reverse KL, signed)."""
    role_args = ["algo.loss.is_mode=none", "algo.loss.distill.gkd_coef=1.0", f"algo.loss.distill.gkd_signal={signal}"] \
        if role == "gkd" else [f"algo.loss.distill.pg_coef={coef}", f"algo.loss.distill.pg_signal={signal}"]
    return load_config(recipe, common + [f"run_dir={run_dir}", f"trainer.lr={lr}", *role_args,
                                         f"sampling.n={n}", f"rollout.prompts_per_step={prompts}",
                                         f"algo.mini_batches={mini_batches}",
                                         f"teachers=[{{name: rl_teacher, model: {teacher}}}]", *overrides])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="recipes/arith_grpo.yaml")
    ap.add_argument("--target", type=float, default=0.50, help="held-out accuracy both must reach")
    ap.add_argument("--rl-steps", type=int, default=1000, help="RL steps; the final policy is the teacher")
    ap.add_argument("--opd-steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--window", type=int, default=3, help="evaluations averaged to decide the target is reached")
    ap.add_argument("--opd-lr", type=float, default=3e-4, help="the student's lr while distilling")
    ap.add_argument("--opd-n", type=int, default=1, help="samples per prompt while distilling (no group baseline "
                                                         "needed: the same samples a step spread over more prompts)")
    ap.add_argument("--opd-prompts", type=int, default=256, help="prompts per step while distilling")
    ap.add_argument("--opd-signal", default="topk_fkl", help="algo.loss.distill.gkd_signal of the OPD run (k2, k3: "
                                                           "the sampled token's logprob only; topk_*/full_*: more)")
    ap.add_argument("--opd-role", choices=["gkd", "pg"], default="gkd", help="gkd: pure distillation (the "
                    "divergence is the loss); pg: RL with the advantage shaped by the teacher, A_t - coef * d_t")
    ap.add_argument("--opd-coef", type=float, default=1.0, help="lambda of the pg role")
    ap.add_argument("--opd-mini-batches", type=int, default=2, help="optimizer steps per OPD batch (pure "
                    "distillation needs no proximal pass for them: the teacher's signal is the loss)")
    ap.add_argument("--rl-run", help="an earlier RL run of this benchmark (its run dir, printed) to reuse: its "
                                     "time to the target and its final policy as the teacher")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    common = common_overrides(args.eval_every, args.overrides)
    rl_dir = args.rl_run or tempfile.mkdtemp(prefix="bench-rl-")
    if not args.rl_run:
        asyncio.run(train(load_config(args.recipe, common + [f"run_dir={rl_dir}", f"train.steps={args.rl_steps}"])))
    print(f"RL run: {rl_dir}")
    teacher = str(Path(rl_dir) / "checkpoints" / "final")
    teacher_acc = sum(r["eval/accuracy"] for r in evals(rl_dir)[-args.window:]) / args.window
    if teacher_acc <= args.target:
        raise SystemExit(f"the RL teacher ends at {teacher_acc:.3f}, not above --target {args.target}: more --rl-steps")
    rl_s, rl_steps = time_to(rl_dir, args.target, args.window)
    opd_dir = tempfile.mkdtemp(prefix="bench-opd-")
    asyncio.run(train(opd_config(args.recipe, common + [f"train.steps={args.opd_steps}"], opd_dir, teacher, args.opd_lr,
                                 args.opd_signal, args.opd_role, args.opd_coef, args.opd_n, args.opd_prompts,
                                 args.opd_mini_batches, tuple(args.overrides))))
    print(f"OPD run: {opd_dir}")
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
