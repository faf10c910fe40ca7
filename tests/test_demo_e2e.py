"""The README's main job (engine demo) as a new user runs it, through the real CLI, and the same
recipe validated in its quick form (`loongsage validate` runs a recipe with a `demo:` section as
the demo and checks its expectations against RUN_DIR/summary.json)."""
from __future__ import annotations

import json
import subprocess
import sys

import yaml


def test_demo_runs_end_to_end_and_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    caches = [f"model.cache_dir={tmp_path / 'models'}", f"task.data_dir={tmp_path / 'data'}"]
    cmd = [sys.executable, "-m", "loongsage.cli", "demo", "recipes/engine_demo.yaml", f"run_dir={run_dir}",
           "demo.num_prompts=12", *caches]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["demo"]["num_prompts"] == 12 and cfg["run_dir"] == str(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["requests"] == 12 and summary["output_tokens"] > 0
    assert summary["weight_version_after_update"] == 1 and summary["outputs_equal_after_reload"] is True
    assert "embedded engine demo" in out.stdout

    quick = tmp_path / "quick"
    out = subprocess.run([sys.executable, "-m", "loongsage.cli", "validate", "recipes/engine_demo.yaml", "--quick",
                          f"run_dir={quick}", *caches], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "embedded engine demo" in out.stdout and "PASSED" in out.stdout, out.stdout[-3000:]
    report = json.loads((quick / "validation.json").read_text())
    assert report["passed"] and report["quick"] and len(report["checks"]) == 4
    assert json.loads((quick / "summary.json").read_text())["requests"] == 12  # the quick override applied
