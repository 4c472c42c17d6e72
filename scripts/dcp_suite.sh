#!/usr/bin/env bash
# DCP's own tests as the measure of the drop-in (issue 44).
#
#   bash scripts/dcp_suite.sh [DIR]            DIR, else $DCP_TESTS_DIR, else /work/dcp-tests
#
# DIR holds pytorch's test files in pytorch's layout (DIR/test/distributed/checkpoint/...), read
# one by one from the public pytorch/pytorch repository at the commits that
# `scripts/dcp_rewrite.py files` lists; they are never part of this repository. For each file:
#   1. a copy forced onto CPU and gloo runs on the installed torch's DCP: the tests passing there
#      are the baseline (the copies found may be newer than the installed torch);
#   2. a copy with its imports rewritten from torch.distributed.checkpoint to distckpt runs on distckpt;
#   3. each baseline test that failed on distckpt runs once more with DISTCKPT_OVERWRITE=1, which
#      tells the failures due only to distckpt's documented overwrite-off default from the rest;
# then it prints the baseline count, how many of those pass on distckpt, and each one that fails
# with a one-line reason. Output: stdout and DIR/_suite/results.txt (copies, logs and junit XML
# beside it). How the copies are forced onto CPU and rewritten: scripts/dcp_rewrite.py's docstring.
#
# Environment: DCP_SUITE_TIMEOUT (seconds per test file and variant, default 900),
# DCP_SUITE_ONLY (a substring: run only the files whose path contains it).
# Runs one pytest at a time (the machine may be shared), with the repository's .venv python.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY="$REPO/.venv/bin/python"
SRC=$(realpath "${1:-${DCP_TESTS_DIR:-/work/dcp-tests}}")
OUT="$SRC/_suite"
TIMEOUT_S="${DCP_SUITE_TIMEOUT:-900}"
ONLY="${DCP_SUITE_ONLY:-}"

[ -x "$PY" ] || { echo "no $PY: run scripts/setup.sh first" >&2; exit 2; }
"$PY" scripts/dcp_rewrite.py check "$SRC" || exit 2

rm -rf "$OUT/baseline" "$OUT/distckpt" "$OUT/junit" "$OUT/logs" "$OUT/scratch" "$OUT/status.json"
mkdir -p "$OUT/junit" "$OUT/logs"
"$PY" scripts/dcp_rewrite.py prepare "$SRC" "$OUT" || exit 2

# torch's test helpers import expecttest, which the project's venv does not carry: install it
# beside the copies (not into the venv) when it is missing.
DEPS="$OUT/deps"
if ! "$PY" -c "import expecttest" 2>/dev/null && ! PYTHONPATH="$DEPS" "$PY" -c "import expecttest" 2>/dev/null; then
    "$PY" -m pip install -q --disable-pip-version-check --target "$DEPS" --no-deps expecttest || exit 2
fi

export PYTHONPATH="$OUT/shim:$DEPS"
export DCP_SUITE_FORCE_CPU=1
export CUDA_VISIBLE_DEVICES=""
export PYTORCH_PRINT_REPRO_ON_FAILURE=0

status="{"
sep=""
for rel in $("$PY" scripts/dcp_rewrite.py files | cut -d' ' -f1); do
    if [ -n "$ONLY" ] && [[ "$rel" != *"$ONLY"* ]]; then continue; fi
    key=${rel//\//__}
    for variant in baseline distckpt; do
        dir="$OUT/$variant"
        echo "== $variant: $rel"
        (cd "$dir" && timeout -k 30 "$TIMEOUT_S" "$PY" -m pytest -q -p no:cacheprovider --rootdir="$dir" \
            --junitxml="$OUT/junit/${variant}__${key}.xml" -o junit_family=xunit1 "$rel") \
            >"$OUT/logs/${variant}__${key}.log" 2>&1
        rc=$?
        tail -n 1 "$OUT/logs/${variant}__${key}.log"
        status="$status$sep\"${variant}__${key}\": $rc"
        sep=", "
    done
done
echo "$status}" >"$OUT/status.json"

# the baseline tests that failed on distckpt, once more with DCP's replace-on-save (DISTCKPT_OVERWRITE=1)
"$PY" scripts/dcp_rewrite.py rerun "$OUT" "$TIMEOUT_S"
"$PY" scripts/dcp_rewrite.py summarize "$OUT"
