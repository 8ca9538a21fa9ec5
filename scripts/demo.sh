#!/usr/bin/env bash
# Fresh-machine main job: set up .venv and run the demo (a small CNN on scikit-learn's bundled
# 8x8 digits with the full monitor), writing the log, dashboard PNG and HTML report to ./demo-out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pip install -q -e ".[demo]" torch==2.13.0
.venv/bin/backprism demo --out demo-out "$@"
