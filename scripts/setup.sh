#!/usr/bin/env bash
# Create .venv (if missing) and install backprism with its test extras, pinning the CPU torch
# wheel that this environment provides (an unpinned `torch` would pull CUDA builds).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
TORCH_SPEC=${BACKPRISM_TORCH:-torch==2.13.0}
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "$TORCH_SPEC"
.venv/bin/python -m pip install -q -e ".[test]" "$TORCH_SPEC"
