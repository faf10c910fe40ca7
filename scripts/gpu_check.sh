#!/usr/bin/env bash
# The GPU paths end to end: the arithmetic recipe, short, with SGLang engines and the Megatron-Core
# trainer on CUDA (NCCL weight sync), sharing one GPU. Prints trained samples/s and weight-sync
# seconds per step. Skips cleanly (exit 0) on a machine without an NVIDIA GPU.
#
#   bash scripts/gpu_check.sh [steps] [extra overrides ...]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[gpu_check] skipped: no NVIDIA GPU here"
  exit 0
fi
steps=${1:-50}
shift || true
venv=${GPU_VENV:-.venv-gpu}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
echo "[gpu_check] installing LoongSage with the gpu and megatron extras into $venv (CUDA wheels; no CPU constraints)"
"$venv/bin/python" -m pip install -q -e ".[dev,gpu,megatron]"
nvidia-smi -L
run_dir=$(mktemp -d /tmp/gpu-check-XXXX)
"$venv/bin/python" -m loongsage.cli train recipes/arith_grpo.yaml "run_dir=$run_dir" "train.steps=$steps" \
  "train.eval_every=$steps" train.max_minutes=null trainer.device=cuda trainer.backend=megatron \
  trainer.gpus_per_rank=0.5 rollout.engine=sglang rollout.engine_gpus=0.5 engine.dtype=bfloat16 \
  "engine.sglang_args=[--mem-fraction-static,0.3]" rollout.max_staleness=1 "$@"
"$venv/bin/python" - "$run_dir" <<'PY'
import json, sys
from loongsage.metrics import read_metrics
recs = [r for r in read_metrics(sys.argv[1]) if r["step"] > 0 and "time/step_s" in r]
steady = recs[len(recs) // 5:]
wall = sum(r["time/step_s"] - r.get("time/eval_s", 0.0) for r in steady)
out = {"steps": len(recs), "samples_per_s": round(sum(r["samples/trained"] for r in steady) / wall, 1),
       "weight_sync_s": round(sum(r["time/weight_sync_s"] for r in steady) / len(steady), 4),
       "step_s": round(wall / len(steady), 4),
       "accuracy": [r["eval/accuracy"] for r in read_metrics(sys.argv[1]) if "eval/accuracy" in r]}
print(json.dumps(out))
PY
