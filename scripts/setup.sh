#!/usr/bin/env bash
# Creates .venv and installs LoongSage with the pinned CPU set (constraints/cpu.txt),
# so a plain `torch` requirement can never pull a multi-GB CUDA build on a CPU box.
# Idempotent: a stamp of the inputs skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.loongsage-installed
want=$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing LoongSage and its pinned CPU dependencies into .venv (about a minute)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints/cpu.txt -e ".[dev,megatron,tracking]" 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
  .venv/bin/python -c "import torch, transformers, ray, loongsage" 
  echo "$want" > "$stamp"
fi
# SGLang's wheel, read but never installed (it needs CUDA to import): tests/test_sglang_contract.py
# checks LoongSage's requests and weight buckets against SGLang's own source in it.
if ! ls .cache/wheels/sglang-0.5.23-*.whl >/dev/null 2>&1; then
  .venv/bin/python -m pip download -q --disable-pip-version-check --no-deps sglang==0.5.23 -d .cache/wheels 2>&1 \
    | grep -v "is ignored: it is neither a file nor a directory" || true
fi
