#!/usr/bin/env bash
# Sets everything up (.venv with the pinned CPU set) and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/loongsage train recipes/arith_grpo.yaml "$@"
