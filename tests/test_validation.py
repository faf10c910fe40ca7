"""Validated recipes: expectations parse with clear errors, are measured exactly as stated from a run
directory, and `loongsage validate --run-dir` prints the verdict, writes the report and exits 1 on a miss."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loongsage.config import ConfigError, load_config
from loongsage.validate import validated_config
from loongsage.validation.check import check, check_run
from loongsage.validation.config import Expectation

RECIPES = sorted(Path("recipes").glob("**/*.yaml"))
RECORDS = [{"step": 0, "eval/accuracy": 0.2}, {"step": 1, "reward/mean": 0.1, "mismatch/kl": None},
           {"step": 2, "reward/mean": 0.5, "mismatch/kl": 1e-6}, {"step": 3, "reward/mean": 0.3, "eval/accuracy": 0.5}]
SUMMARY = {"train_seconds": 90.0, "sources": {"a": {"eval_after": 0.45, "teacher_accuracy": {"t": 0.5}}}}


def measured(**kw) -> float | None:
    return check([Expectation(**kw, min=-1e9)], RECORDS, SUMMARY)[0].measured


def test_each_statistic_is_measured_over_the_steps_that_logged_the_metric():
    assert measured(metric="reward/mean") == 0.3 and measured(metric="reward/mean", stat="first") == 0.1
    assert measured(metric="reward/mean", stat="max") == 0.5 and measured(metric="reward/mean", stat="min") == 0.1
    assert measured(metric="reward/mean", stat="mean") == pytest.approx(0.3)
    assert measured(metric="eval/accuracy", stat="rise") == pytest.approx(0.3)  # step 0 (before training) counts
    assert measured(metric="reward/mean", stat="rise", window=2) == pytest.approx(0.4 - 0.3)  # means at each end
    assert check([Expectation(metric="reward/mean", stat="rise", window=4, min=0)], RECORDS, SUMMARY)[0].problem == \
        "reward/mean: 3 values in metrics.jsonl, fewer than the window of 4"
    assert measured(metric="mismatch/kl", stat="max") == 1e-6  # a null (a step that trained nothing) is skipped
    assert measured(metric="summary.train_seconds") == 90.0
    assert measured(metric="summary.sources.a.eval_after", over="summary.sources.a.teacher_accuracy.t") == pytest.approx(0.9)


def test_bounds_pass_and_fail_and_a_missing_metric_fails_with_its_reason():
    ok, low, high, missing, nested = check([
        Expectation(metric="eval/accuracy", stat="rise", min=0.25),
        Expectation(metric="eval/accuracy", stat="rise", min=0.35),
        Expectation(metric="reward/mean", stat="max", max=0.4),
        Expectation(metric="time/step_s", max=1.0),
        Expectation(metric="summary.sources.b.eval_after", min=0.1)], RECORDS, SUMMARY)
    assert ok.passed and not low.passed and not high.passed
    assert (missing.passed, missing.measured, missing.problem) == (False, None, "time/step_s: no step logged it in metrics.jsonl")
    assert not nested.passed and nested.problem == "summary.sources.b.eval_after: not in summary.json"
    assert check([Expectation(metric="reward/mean", over="summary.sources.a.teacher_accuracy",
                              min=0)], RECORDS, SUMMARY)[0].problem.endswith("not a number in summary.json ({'t': 0.5})")


@pytest.mark.parametrize("entry, message", [
    ({"metric": "eval/accuracy"}, "has neither min nor max"),
    ({"metric": "eval/accuracy", "min": 0.5, "max": 0.4}, "min 0.5 is above max 0.4"),
    ({"metric": "summary.train_seconds", "stat": "rise", "max": 1}, "is one number"),
    ({"metric": "eval/accuracy", "stat": "median", "min": 0}, "expect.0.stat"),
    ({"metric": "eval/accuracy", "mni": 0.5}, "expect.0.mni: unknown key; expected one of: metric, stat, window, over, min"),
])
def test_a_bad_expectation_is_a_config_error_naming_it(tmp_path, entry, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"expect": [entry]}))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(recipe)


def test_quick_overrides_come_before_the_users_and_quick_expect_defaults_to_expect(tmp_path):
    recipe = tmp_path / "r.yaml"
    body = {"expect": [{"metric": "eval/accuracy", "stat": "rise", "min": 0.25}],
            "quick": {"overrides": ["train.steps=7", "train.eval_every=7"]}}
    recipe.write_text(yaml.safe_dump(body))
    cfg, expect = validated_config(str(recipe), ["train.eval_every=3"], quick=True)
    assert (cfg.train.steps, cfg.train.eval_every) == (7, 3) and expect == cfg.expect
    full, _ = validated_config(str(recipe), [], quick=False)
    assert full.train.steps == 100  # the default: quick overrides only with --quick
    body["quick"]["expect"] = [{"metric": "eval/accuracy", "stat": "rise", "min": 0.05}]
    recipe.write_text(yaml.safe_dump(body))
    assert validated_config(str(recipe), [], quick=True)[1][0].min == 0.05
    recipe.write_text(yaml.safe_dump({"train": {"steps": 5}}))
    with pytest.raises(ConfigError, match="no expectations to validate"):
        validated_config(str(recipe), [], quick=False)


@pytest.mark.parametrize("recipe", RECIPES, ids=[str(r.relative_to("recipes")) for r in RECIPES])
def test_every_recipe_states_what_it_must_achieve_in_full_and_quick_form(recipe):
    cfg = load_config(recipe)
    assert cfg.expect, f"{recipe}: no expect: section"
    quick, expect = validated_config(str(recipe), [], quick=True)
    assert expect and quick.quick.overrides, f"{recipe}: no quick form"


def test_validate_cli_checks_a_finished_run_writes_the_report_and_exits_1_on_a_miss(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    recipe = tmp_path / "r.yaml"
    expect = [{"metric": "eval/accuracy", "stat": "rise", "min": 0.25}, {"metric": "summary.train_seconds", "max": 60}]
    recipe.write_text(yaml.safe_dump({"expect": expect}))
    out = subprocess.run([sys.executable, "-m", "loongsage.cli", "validate", str(recipe), "--run-dir", str(run)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rise(eval/accuracy)" in out.stdout and "FAIL" in out.stdout and "FAILED" in out.stdout
    report = json.loads((run / "validation.json").read_text())
    assert report["passed"] is False and [c["passed"] for c in report["checks"]] == [True, False]
    assert (run / "validation.md").read_text().count("| pass |") == 1 and (run / "curves.png").is_file()
    recipe.write_text(yaml.safe_dump({"expect": expect[:1]}))
    out = subprocess.run([sys.executable, "-m", "loongsage.cli", "validate", str(recipe), "--run-dir", str(run)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "PASSED" in out.stdout, out.stdout + out.stderr
    assert check_run(run, [Expectation(**expect[0])])[0].measured == pytest.approx(0.3)


def test_overrides_may_follow_options_and_an_unknown_option_is_still_refused(tmp_path, capsys):
    from loongsage.cli import main

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"expect": [{"metric": "summary.train_seconds", "max": 60}]}))
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(SUMMARY))
    assert main(["validate", str(recipe), "--run-dir", str(run), "train.steps=3"]) == 1  # 90 s > 60
    with pytest.raises(SystemExit) as exc:
        main(["validate", str(recipe), "--run-dir", str(run), "--bogus"])
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_the_recipes_page_is_rendered_from_the_latest_validated_run_of_each_recipe(tmp_path):
    from loongsage.validation.check import write_report
    from loongsage.validation.render import render

    runs = []
    for i, (recipe, accuracy) in enumerate([("recipes/a.yaml", 0.5), ("recipes/a.yaml", 0.6), ("recipes/b.yaml", 0.1)]):
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": accuracy}) + "\n")
        (run / "curves.png").write_bytes(b"png")
        write_report(run, check_run(run, [Expectation(metric="eval/accuracy", min=0.3)]), recipe, False)
        runs.append(run)
    page = render(runs, tmp_path / "docs" / "recipes.md").read_text()
    assert "| `eval/accuracy` | >= 0.3 | 0.6 | pass |" in page and "| 0.5 |" not in page  # the later run of a
    assert "| `eval/accuracy` | >= 0.3 | 0.1 | FAIL |" in page
    assert (tmp_path / "docs" / "img" / "recipes" / "b-curves.png").read_bytes() == b"png"
    write_report(runs[2], check_run(runs[2], [Expectation(metric="eval/accuracy", min=0.05)]), "recipes/b.yaml", False)
    page = render([runs[2]], tmp_path / "docs" / "recipes.md").read_text()  # a's run is not given again:
    assert "| `eval/accuracy` | >= 0.3 | 0.6 | pass |" in page  # its kept report still shows, with its plot
    assert "| `eval/accuracy` | >= 0.05 | 0.1 | pass |" in page and "FAIL" not in page
    assert "![a curves](img/recipes/a-curves.png)" in page
    with pytest.raises(FileNotFoundError, match="not validated"):
        render([tmp_path], tmp_path / "x.md")


def test_a_gpu_recipe_on_a_machine_without_one_says_so_and_runs_nothing(tmp_path, capsys, monkeypatch):
    import loongsage.validate as v

    monkeypatch.setattr(v, "gpu_available", lambda: False)
    recipe = "recipes/gpu/qwen3_0.6b_gsm8k_grpo.yaml"
    assert v.validate(recipe, [f"run_dir={tmp_path / 'run'}"], quick=True) == v.NOT_RUN == 3
    err = capsys.readouterr().err
    assert "needs an NVIDIA GPU (trainer.device=cuda, rollout.engine=sglang)" in err and "not run" in err
    assert not (tmp_path / "run").exists()
    cfg, expect = validated_config(recipe, [], quick=False)
    assert cfg.model.path == "models/Qwen3-0.6B-Base" and cfg.task.name == "math" and cfg.trainer.backend == "megatron"
    assert v.needs_gpu(load_config("recipes/arith_grpo.yaml")) == []
    from pathlib import Path

    for other in sorted(Path("recipes/gpu").glob("*.yaml")):  # every GPU recipe loads and is refused here
        assert v.validate(str(other), [f"run_dir={tmp_path / other.stem}"], quick=True) == v.NOT_RUN, other
        assert not (tmp_path / other.stem).exists()
    assert len(list(Path("recipes/gpu").glob("*.yaml"))) >= 3
