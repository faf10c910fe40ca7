"""The SGLang path on a machine without a GPU: the launch command mirrors the engine config, a
missing SGLang is a clear error, and scripts/gpu_check.sh skips cleanly."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loongsage.engine.config import EngineConfig
from loongsage.rollout.launcher import launch_sglang, sglang_command

ROOT = Path(__file__).resolve().parents[1]


def test_sglang_command_mirrors_the_engine_config():
    cfg = EngineConfig(dtype="bfloat16", max_running=96, context_length=2048, prefix_cache=False, weight_version=7,
                       sglang_args=["--tp-size", "2"])
    cmd = sglang_command("/models/qwen3", "127.0.0.1", 30000, cfg.sglang_args_for())
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--model-path"] == "/models/qwen3" and flags["--host"] == "127.0.0.1" and flags["--port"] == "30000"
    assert flags["--dtype"] == "bfloat16" and flags["--max-running-requests"] == "96"
    assert flags["--context-length"] == "2048" and flags["--weight-version"] == "7"
    assert "--disable-radix-cache" in cmd and cmd[-2:] == ["--tp-size", "2"]
    keyed = sglang_command("/models/qwen3", "10.0.0.5", 30000, cfg.sglang_args_for(), api_key="k1")
    assert keyed[-2:] == ["--api-key", "k1"]  # SGLang's own auth: every route but /health needs it


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_sglang_engine_without_sglang_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"rollout.engine=sglang needs SGLang on a GPU node: pip install -e .\[gpu\]"):
        launch_sglang("/models/qwen3", [])


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU check would really run here")
def test_gpu_check_skips_cleanly_without_a_gpu():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "skipped: no NVIDIA GPU" in out.stdout
    assert stage_reports(out.stdout) == {s: ("skipped", "no NVIDIA GPU") for s in ("transports", "transfer_mesh", "recipe")}


def stage_reports(stdout: str) -> dict[str, tuple[str, str | None]]:
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith('{"gpu_check"')]
    return {r["gpu_check"]: (r["status"], r.get("reason")) for r in lines}


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU check would really run here")
def test_gpu_check_reports_every_stage_as_one_json_line_and_goes_on_past_a_failure(tmp_path):
    """With an `nvidia-smi` that claims a GPU torch cannot see, stage 1 really runs and fails, stage 2
    runs its GPU tests, which skip themselves, and stage 3 reports why it cannot run; exit status 1."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: claimed by a test'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "GPU_PYTHON": sys.executable}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                         timeout=180, env=env, cwd=ROOT)
    reports = stage_reports(out.stdout)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert list(reports) == ["transports", "transfer_mesh", "recipe"]
    assert reports["transports"][0] == "failed"
    assert reports["transfer_mesh"] == ("skipped", "every GPU test skipped itself (torch sees no CUDA device?)")
    if importlib.util.find_spec("sglang") is None:
        assert reports["recipe"] == ("skipped", "sglang or megatron-core is missing (the gpu and megatron extras)")
