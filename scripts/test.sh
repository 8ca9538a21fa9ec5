#!/usr/bin/env bash
# Fresh-machine test command: set up .venv, lint, run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
BACKPRISM_BROWSER=${BACKPRISM_BROWSER:-1} bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
