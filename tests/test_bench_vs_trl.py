"""benchmarks/vs_trl.py without TRL (an extra CI does not install): every workload's recipe with its
schedule is a valid run config, and the comparison point is chosen as documented; and
benchmarks/opd_vs_rl.py's OPD configuration and time-to-target reading."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from loongsage.config import load_config

BENCH = Path(__file__).parents[1] / "benchmarks" / "vs_trl.py"


@pytest.fixture(scope="module")
def vs_trl():
    spec = importlib.util.spec_from_file_location("vs_trl", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_workload_is_a_valid_run_with_its_own_schedule(vs_trl):
    schedules = {}
    for name, work in vs_trl.WORKLOADS.items():
        cfg = load_config(work["recipe"], [f"train.steps={work['max_steps']}", *work["schedule"]])
        schedules[name] = cfg.rollout.max_staleness
        assert cfg.rollout.coalesce_prompts == 64  # a step's group requests go out as one
        assert cfg.rollout.seeded_sampling  # a seed's run repeats, as TRL's seeded one does
        assert cfg.train.steps == work["max_steps"] and work["max_steps"] % work["eval_every"] == 0
    assert schedules == {"short": 0, "long": 1}  # the choices the module docstring explains
    long = load_config(vs_trl.WORKLOADS["long"]["recipe"])
    assert long.task.name == "count" and long.sampling.max_new_tokens >= 128


def test_the_comparison_point_is_the_first_eval_at_the_target_or_the_last_step(vs_trl):
    curve = [(0, 5.0, 0.30), (10, 20.0, 0.38), (20, 35.0, 0.41), (30, 50.0, 0.39), (40, 65.0, 0.45)]
    assert vs_trl.reached(curve, 0.40, 40) == (20, 35.0, 0.41)
    assert vs_trl.reached(curve, 0.50, 40) is None  # never reached: no ratio
    assert vs_trl.reached(curve, None, 40) == (40, 65.0, 0.45)  # equal work: after the steps
    assert vs_trl.reached(curve[:-1], None, 40) is None  # a run that stopped early did not do the work


def test_each_seed_starts_from_the_same_base_and_the_medians_decide(vs_trl, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    work = vs_trl.WORKLOADS["short"]
    common = vs_trl.run_overrides(work, 40, 10, 0.4, ["trainer.lr=2e-4"])
    cfg = load_config(work["recipe"], [*common, *vs_trl.seeded_overrides(str(base), 7)])
    assert (cfg.seed, cfg.model.path, cfg.bootstrap.enabled) == (7, str(base), False)  # no bootstrap per seed
    assert cfg.trainer.lr == 2e-4 and cfg.train.target_accuracy == 0.4 and cfg.train.steps == 40
    assert vs_trl.without_option(["--workload", "short", "--seeds", "0,1", "--seeds=3", "x=1"], "--seeds") == [
        "--workload", "short", "x=1"]

    def run(seed, ls_curve, ls_imports, trl_curve, trl_imports):
        per_step = {"step_s": 0.3, "generate_s": 0.1, "train_s": 0.2}
        return {"seed": seed, "loongsage": {"curve": ls_curve, "imports_s": ls_imports, "per_step": per_step},
                "trl": {"curve": trl_curve, "imports_s": trl_imports, "per_step": per_step}}
    runs = [run(0, [(10, 20.0, 0.3), (20, 30.0, 0.41)], 5.0, [(10, 20.0, 0.41)], 10.0),
            run(1, [(10, 20.0, 0.42)], 5.0, [(10, 20.0, 0.2), (20, 40.0, 0.45)], 10.0),
            run(2, [(10, 20.0, 0.2), (20, 30.0, 0.3), (30, 60.0, 0.40)], 6.0, [(10, 30.0, 0.4)], 12.0)]
    out = vs_trl.summarize("short", 0.4, 40, "sync", runs)
    assert (out["loongsage_s"], out["trl_s"], out["ratio"]) == (30.0, 30.0, 1.0)  # medians of 30/20/60 and 20/40/30
    assert (out["loongsage_steps"], out["trl_steps"]) == (20, 10)
    assert out["ratio_after_imports"] == round(18.0 / 25.0, 3)  # medians of 10/30/18 and 25/15/54
    assert out["runs"][2]["loongsage_point"] == (30, 60.0, 0.40)
    runs[1]["trl"]["curve"] = [(40, 80.0, 0.39)]  # one seed short of the target: no median, no ratio
    out = vs_trl.summarize("short", 0.4, 40, "sync", runs)
    assert out["trl_s"] is None and out["ratio"] is None and out["loongsage_s"] == 30.0


def test_opd_vs_rl_distils_purely_from_the_rl_policy_and_times_a_smoothed_reach_of_the_target(tmp_path):
    spec = importlib.util.spec_from_file_location("opd_vs_rl", BENCH.with_name("opd_vs_rl.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = bench.opd_config("recipes/arith_grpo.yaml", ["train.steps=10"], str(tmp_path / "opd"), str(tmp_path / "t"))
    assert [t.name for t in cfg.teachers] == ["rl_teacher"] and cfg.sources()[0].teachers == {"rl_teacher": 1.0}
    d = cfg.algo.loss.distill
    assert (d.gkd_coef, d.gkd_signal, cfg.train.target_accuracy) == (1.0, "topk_fkl", None)  # runs all its steps
    assert cfg.algo.loss.is_mode == "none" and d.pg_coef == 0.0
    assert cfg.trainer.lr == 3e-4  # 3x the RL run's (measured: 200 steps to the target against 280 at 1e-4)
    # no group baseline to feed: the RL run's 256 samples a step over 256 prompts, not 32 (3-4x fewer steps)
    assert (cfg.sampling.n, cfg.rollout.prompts_per_step) == (1, 256)
    assert cfg.algo.mini_batches == 2 and not cfg.algo.needs_proximal_pass  # two updates a batch, no extra pass
    both = bench.common_overrides(20, ["seed=3"])
    assert load_config("recipes/arith_grpo.yaml", both).rollout.coalesce_prompts == 64 and both[-1] == "seed=3"
    pg = bench.opd_config("recipes/arith_grpo.yaml", ["train.steps=10"], str(tmp_path / "pg"), str(tmp_path / "t"),
                          signal="k1", role="pg", coef=0.5, overrides=("trainer.lr=2e-4",))
    assert (pg.algo.loss.distill.pg_coef, pg.algo.loss.distill.pg_signal, pg.algo.loss.distill.gkd_coef) == (0.5, "k1", 0.0)
    assert pg.algo.loss.is_mode == "tis" and pg.trainer.lr == 2e-4  # the recipe's RL loss; overrides come last
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "eval/accuracy": 0.5, "time/elapsed_s": 1.0},  # the base policy's own eval never counts
            {"step": 5, "loss": 1.0, "time/elapsed_s": 9.0}, {"step": 10, "eval/accuracy": 0.45, "time/elapsed_s": 20.0},
            {"step": 20, "eval/accuracy": 0.30, "time/elapsed_s": 41.0},
            {"step": 30, "eval/accuracy": 0.40, "time/elapsed_s": 60.0},
            {"step": 40, "eval/accuracy": 0.60, "time/elapsed_s": 80.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.time_to(str(run), 0.4, window=1) == (20.0, 10)  # one lucky evaluation
    assert bench.time_to(str(run), 0.4, window=3) == (80.0, 40)  # (0.30 + 0.40 + 0.60) / 3 >= 0.4; 0.383 at step 30
    assert bench.time_to(str(run), 0.9) == (None, None)
