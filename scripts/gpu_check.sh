#!/usr/bin/env bash
# The GPU paths, in three stages. Each stage ends with one JSON line,
#   {"gpu_check": STAGE, "status": "ok" | "failed" | "skipped", ...its numbers or the reason}
# so that GPU sessions compare like with like (`grep '"gpu_check"'`). A failed stage does not stop
# the next; the exit status is 1 if any stage failed. Without an NVIDIA GPU every stage is skipped
# (exit 0).
#  1. transports (needs only torch + safetensors): CUDA IPC one-copy / two-copy, NCCL broadcast and
#     disk between two processes on one GPU, each transfer checked bit for bit (benchmarks/weight_sync.py).
#  2. TransferMesh on the GPU (needs LoongSage's dependencies: Ray, FastAPI, ...): the FSDP2 trainer and
#     an embedded engine on one GPU, synced over cuda_ipc (mapped, and SGLang's handle way) and NCCL,
#     every version checksummed (pytest, the GPU-marked transport tests).
#  3. the arithmetic recipe, short: Megatron-Core trainer + SGLang engines sharing one GPU (needs the
#     gpu and megatron extras). Reports trained samples/s and weight-sync seconds per step.
# Stages 2 and 3 run when their packages import, or can be installed (GPU_CHECK_INSTALL=1 installs
# into $GPU_VENV, default .venv-gpu, with CUDA wheels and without the CPU constraints).
#
#   bash scripts/gpu_check.sh [steps] [extra overrides for stage 3 ...]
set -uo pipefail
cd "$(dirname "$0")/.."
STAGES=(transports transfer_mesh recipe)
failed=0
report() {  # report STAGE STATUS [JSON object of details]
  local details=${3:-"{}"}
  python3 - "$1" "$2" "$details" <<'PY'
import json, sys
try:
    details = json.loads(sys.argv[3])
except ValueError:
    details = {"details": sys.argv[3]}
print(json.dumps({"gpu_check": sys.argv[1], "status": sys.argv[2], **details}))
PY
  [ "$2" = failed ] && failed=1
  return 0
}
skip_from() {  # skip_from INDEX REASON: every stage from INDEX on is skipped for REASON
  local i
  for ((i = $1; i < ${#STAGES[@]}; i++)); do
    report "${STAGES[$i]}" skipped "$(python3 -c 'import json, sys; print(json.dumps({"reason": sys.argv[1]}))' "$2")"
  done
}
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "[gpu_check] skipped: no NVIDIA GPU here"
  skip_from 0 "no NVIDIA GPU"
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
work=$(mktemp -d /tmp/gpu-check-XXXX)

echo "[gpu_check] stage 1: raw transports on one GPU (GB/s; every transfer verified)"
if "$py" benchmarks/weight_sync.py --device cuda --sizes-mb 10 100 1000 --repeats 3 | tee "$work/transports.log"; then
  report transports ok "$(tail -n 1 "$work/transports.log")"
else
  report transports failed "{\"rc\": $?}"
fi

if ! "$py" -c "import ray, fastapi, uvicorn, pydantic, aiohttp, pytest" 2>/dev/null; then
  skip_from 1 "LoongSage's dependencies are missing (GPU_CHECK_INSTALL=1 installs them)"
  exit $failed
fi
echo "[gpu_check] stage 2: TransferMesh routes on the GPU (cuda_ipc, cuda_ipc_handles, collective_nccl)"
"$py" -m pytest -q -ra tests/test_trainer_fsdp.py -k "cuda_ipc or nccl" --junitxml "$work/mesh.xml"
rc=$?
read -r status details < <("$py" - "$work/mesh.xml" $rc <<'PY'
import json, sys, xml.etree.ElementTree as ET
try:
    s = ET.parse(sys.argv[1]).getroot()
    s = s if s.tag == "testsuite" else s.find("testsuite")
    counts = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except (OSError, ET.ParseError) as e:
    counts = {"error": f"no pytest report: {e}"}
ran = counts.get("tests", 0) - counts.get("skipped", 0)
status = "failed" if sys.argv[2] != "0" or "error" in counts else "ok" if ran else "skipped"
if status == "skipped":
    counts["reason"] = "every GPU test skipped itself (torch sees no CUDA device?)"
print(status, json.dumps(counts))
PY
)
report transfer_mesh "$status" "$details"

if ! "$py" -c "import sglang, megatron.core" 2>/dev/null; then
  skip_from 2 "sglang or megatron-core is missing (the gpu and megatron extras)"
  exit $failed
fi
echo "[gpu_check] stage 3: arithmetic recipe, Megatron-Core trainer + SGLang engine on one GPU"
run_dir="$work/recipe"
if "$py" -m loongsage.cli train recipes/arith_grpo.yaml "run_dir=$run_dir" "train.steps=$steps" \
  "train.eval_every=$steps" train.max_minutes=null trainer.device=cuda trainer.backend=megatron \
  trainer.gpus_per_rank=0.5 rollout.engine=sglang rollout.engine_gpus=0.5 engine.dtype=bfloat16 \
  "engine.sglang_args=[--mem-fraction-static,0.3]" rollout.max_staleness=1 "$@"; then
  report recipe ok "$("$py" - "$run_dir" <<'PY'
import json, sys
from loongsage.metrics import read_metrics
recs = [r for r in read_metrics(sys.argv[1]) if r["step"] > 0 and "time/step_s" in r]
steady = recs[len(recs) // 5:]
wall = sum(r["time/step_s"] - r.get("time/eval_s", 0.0) for r in steady)
out = {"steps": len(recs), "samples_per_s": round(sum(r["samples/trained"] for r in steady) / wall, 1),
       "weight_sync_s": round(sum(r["time/weight_sync_s"] for r in steady) / len(steady), 4),
       "step_s": round(wall / len(steady), 4), "run_dir": sys.argv[1],
       "accuracy": [r["eval/accuracy"] for r in read_metrics(sys.argv[1]) if "eval/accuracy" in r]}
print(json.dumps(out))
PY
)"
else
  report recipe failed "{\"rc\": $?, \"run_dir\": \"$run_dir\"}"
fi
exit $failed
