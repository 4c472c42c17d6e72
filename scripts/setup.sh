#!/usr/bin/env bash
# Create .venv if needed and install distckpt with its test extras.
# constraints.txt pins torch==2.13.0, so pip takes the CPU build on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.distckpt-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q --no-compile -c constraints.txt -e ".[test,bench]"
  # byte-compiled on every core (pip compiles on one): the suite's hundreds of processes import from here, and
  # PYTHONDONTWRITEBYTECODE, where set, keeps each of them from writing what it compiled
  .venv/bin/python -m compileall -q -j 0 .venv/lib >/dev/null 2>&1 || true
  touch "$stamp"
fi
# Azurite, the Azure Storage emulator the az:// tests run on loopback, from npm into the virtualenv (the version
# tests/storage/azurite_server.py names); without npm the az:// tests install nothing and skip, saying why
azurite=.venv/azurite
if [ ! -x "$azurite/node_modules/.bin/azurite-blob" ] && command -v npm >/dev/null 2>&1; then
  npm install --prefix "$azurite" --no-audit --no-fund --loglevel=error azurite@3.35.0 >/dev/null \
    || echo "setup: npm could not install Azurite into $azurite; the az:// tests will say why" >&2
fi
