#!/usr/bin/env bash
# Set up (or reuse) .venv and run the demonstration: 2-rank FSDP2 training that
# checkpoints, crashes, resumes bit-exactly, then reshards to 1 and 3 ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -W ignore::UserWarning -m distckpt.demo "$@"
