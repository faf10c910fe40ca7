"""The README's main job (engine demo) as a new user runs it, through the real CLI."""
from __future__ import annotations

import json
import subprocess
import sys

import yaml


def test_demo_runs_end_to_end_and_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "loongsage.cli", "demo", "recipes/engine_demo.yaml", f"run_dir={run_dir}",
           "demo.num_prompts=12", f"model.cache_dir={tmp_path / 'models'}", f"task.data_dir={tmp_path / 'data'}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["demo"]["num_prompts"] == 12 and cfg["run_dir"] == str(run_dir)
    summary = json.loads((run_dir / "demo.json").read_text())
    assert summary["requests"] == 12 and summary["output_tokens"] > 0
    assert summary["weight_version_after_update"] == 1 and summary["outputs_equal_after_reload"] is True
    assert "embedded engine demo" in out.stdout
