#!/usr/bin/env bash
# Set up (or reuse) .venv, lint, check the package as users install it (scripts/wheel_check.sh: the wheel in a
# fresh virtualenv with no extras), and run the whole test suite. Extra arguments go to pytest (for example
# --run-slow for the larger sweeps).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint first (pyflakes, import order, line length: pyproject.toml's [tool.ruff]); a finding fails the run
.venv/bin/ruff check src tests bench scripts
bash scripts/wheel_check.sh
exec .venv/bin/python -m pytest -q "$@"
