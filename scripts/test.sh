#!/usr/bin/env bash
# Set up (or reuse) .venv, lint, check the package as users install it (scripts/wheel_check.sh: the wheel in a
# fresh virtualenv with no extras), and run the whole test suite. Extra arguments go to pytest (for example
# --run-slow for the larger sweeps).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# lint first (pyflakes, import order, line length: pyproject.toml's [tool.ruff]); a finding fails the run
.venv/bin/ruff check src tests bench scripts
# the wheel check installs torch into a fresh virtualenv, which waits on the disk more than it computes: it runs
# beside the suite, and its verdict (and log, if it failed) comes after the suite's
wheel_log=$(mktemp "${TMPDIR:-/tmp}/distckpt-wheel-check-XXXXXX.log")
bash scripts/wheel_check.sh >"$wheel_log" 2>&1 &
wheel_pid=$!
# three workers on two cores: the suite's processes spend much of their time waiting (on peers, timeouts, starting
# ranks); docs/testing.md has the measurements. DISTCKPT_TEST_WORKERS=0 runs it in this process.
workers=${DISTCKPT_TEST_WORKERS:-3}
status=0
if [ "$workers" = 0 ]; then
  .venv/bin/python -m pytest -q "$@" || status=$?
else
  .venv/bin/python -m pytest -q -n "$workers" --dist worksteal "$@" || status=$?
fi
if wait "$wheel_pid"; then
  grep -E "^(wheel check|install smoke): (ok: the wheel|passed|ok: distckpt\[)" "$wheel_log" || true
else
  cat "$wheel_log"
  echo "wheel check: FAILED (above)"
  [ "$status" != 0 ] || status=1
fi
rm -f "$wheel_log"
exit "$status"
