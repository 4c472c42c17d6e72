#!/usr/bin/env bash
# Set up (or reuse) .venv and run the whole test suite. Extra arguments go to pytest
# (for example --run-slow for the larger sweeps).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
