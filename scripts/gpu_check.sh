#!/usr/bin/env bash
# The GPU paths, in three stages, each printing its numbers; skips cleanly (exit 0) without an NVIDIA GPU.
#  1. transports (needs only torch + safetensors): CUDA IPC one-copy / two-copy, NCCL broadcast and
#     disk between two processes on one GPU, each transfer checked bit for bit (benchmarks/weight_sync.py).
#  2. TransferMesh on the GPU (needs LoongSage's dependencies: Ray, FastAPI, ...): the FSDP2 trainer and
#     an embedded engine on one GPU, synced over cuda_ipc (mapped, and SGLang's handle way) and NCCL,
#     every version checksummed (pytest, the GPU-marked transport tests).
#  3. the arithmetic recipe, short: Megatron-Core trainer + SGLang engines sharing one GPU (needs the
#     gpu and megatron extras). Prints trained samples/s and weight-sync seconds per step.
# Stages 2 and 3 run when their packages import, or can be installed (GPU_CHECK_INSTALL=1 installs
# into $GPU_VENV, default .venv-gpu, with CUDA wheels and without the CPU constraints).
#
#   bash scripts/gpu_check.sh [steps] [extra overrides for stage 3 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[gpu_check] skipped: no NVIDIA GPU here"
  exit 0
fi
steps=${1:-50}
shift || true
nvidia-smi -L
py=${GPU_PYTHON:-python3}
if [ "${GPU_CHECK_INSTALL:-0}" = 1 ]; then
  venv=${GPU_VENV:-.venv-gpu}
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  echo "[gpu_check] installing LoongSage with the dev, gpu and megatron extras into $venv"
  "$venv/bin/python" -m pip install -q -e ".[dev,gpu,megatron]"
  py="$venv/bin/python"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "[gpu_check] stage 1: raw transports on one GPU (GB/s; every transfer verified)"
"$py" benchmarks/weight_sync.py --device cuda --sizes-mb 10 100 1000 --repeats 3

if ! "$py" -c "import ray, fastapi, uvicorn, pydantic, aiohttp, pytest" 2>/dev/null; then
  echo "[gpu_check] stages 2-3 skipped: LoongSage's dependencies are missing (GPU_CHECK_INSTALL=1 installs them)"
  exit 0
fi
echo "[gpu_check] stage 2: TransferMesh routes on the GPU (cuda_ipc, cuda_ipc_handles, collective_nccl)"
"$py" -m pytest -q -ra tests/test_trainer_fsdp.py -k "cuda_ipc or nccl"

if ! "$py" -c "import sglang, megatron.core" 2>/dev/null; then
  echo "[gpu_check] stage 3 skipped: sglang or megatron-core is missing (the gpu and megatron extras)"
  exit 0
fi
echo "[gpu_check] stage 3: arithmetic recipe, Megatron-Core trainer + SGLang engine on one GPU"
run_dir=$(mktemp -d /tmp/gpu-check-XXXX)
"$py" -m loongsage.cli train recipes/arith_grpo.yaml "run_dir=$run_dir" "train.steps=$steps" \
  "train.eval_every=$steps" train.max_minutes=null trainer.device=cuda trainer.backend=megatron \
  trainer.gpus_per_rank=0.5 rollout.engine=sglang rollout.engine_gpus=0.5 engine.dtype=bfloat16 \
  "engine.sglang_args=[--mem-fraction-static,0.3]" rollout.max_staleness=1 "$@"
"$py" - "$run_dir" <<'PY'
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
