#!/usr/bin/env bash
# The project's test command: sets up .venv if needed, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check loongsage tests benchmarks examples scripts  # the lint configuration in pyproject.toml
exec .venv/bin/python -m pytest -q -ra --durations=12 "$@"
