#!/usr/bin/env bash
# Set up (or reuse) .venv, lint, and run the whole test suite. Extra arguments go to pytest
# (for example --run-slow for the larger sweeps).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint first (pyflakes, import order, line length: pyproject.toml's [tool.ruff]); a finding fails the run
.venv/bin/ruff check src tests bench
exec .venv/bin/python -m pytest -q "$@"
