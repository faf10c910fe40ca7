#!/usr/bin/env bash
# A real two-node Ray cluster on this machine (network namespace + veth pair), the arith recipe run
# across it; last line JSON {"nodes", "routes", "max_gap", "eval_before", "eval_after"}. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/two_node_check.py "$@"
