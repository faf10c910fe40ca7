#!/usr/bin/env bash
# The project's test command: sets up .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -ra --durations=12 "$@"
