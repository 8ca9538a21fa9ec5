#!/usr/bin/env bash
# Create .venv (if missing) and install backprism with its test extras, pinning the CPU torch
# wheel that this environment provides (an unpinned `torch` would pull CUDA builds).
# With BACKPRISM_BROWSER=1 (the test command sets it) also install Debian's chromium for the
# HTML-report browser test when running as root with apt-get (skipped otherwise; the test
# then skips with its reason).
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
if [ "${BACKPRISM_BROWSER:-0}" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
      >/dev/null) || echo "setup: could not install chromium; the browser test will skip" >&2
  else
    echo "setup: chromium not installed (needs root + apt-get); the browser test will skip" >&2
  fi
fi
