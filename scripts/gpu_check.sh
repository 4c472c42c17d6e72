#!/usr/bin/env bash
# The GPU check: on a machine with one or more CUDA devices, every device path for correctness, then the GPU
# figures beside the raw floor, in under 8 minutes. Run it where a GPU machine is lent (the device tool runs it
# in a copy of the working tree) and record what it prints in bench/results (README there).
#
#   bash scripts/gpu_check.sh            # results under $OUT if set (the device tool's), else bench/results
#
# Correctness (tests/cuda, pytest): sync and async save/load of CUDA tensors of every dtype, between devices;
# a CUDA module and optimizer; side streams; pinned staging (one arena, reused, refused pins); DTensors on CUDA
# at 1-3 ranks; with 2+ GPUs an NCCL group's saves and resharded loads, sync and async, and shared reads over
# NCCL (each byte read once, delivered on the device). Then bench.gpu at 1 GiB: the pinned copy floors, sync
# save and load beside DCP, torch.save and safetensors, and async saves (blocked time, total, training slowdown).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if [ ! -x .venv/bin/python ]; then
  # where the machine's torch is a CUDA build, use it rather than installing one
  if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    python3 -m venv --system-site-packages .venv
    .venv/bin/python -m pip install -q -e ".[test]" --no-deps
    .venv/bin/python -m pip install -q fastcrc click tqdm safetensors blake3 zstandard pytest hypothesis
  else
    bash scripts/setup.sh
  fi
fi
PY=.venv/bin/python
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu check: no CUDA device visible to $("$PY" -c 'import torch; print(torch.__version__)'): nothing to check"
  exit 2
fi
out=${OUT:-bench/results}
mkdir -p "$out"
tag="cuda-check-$(date +%Y-%m-%d)"
"$PY" - <<'PYEOF' | tee "$out/$tag.txt"
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  device {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB")
PYEOF
echo "== correctness: pytest tests/cuda" | tee -a "$out/$tag.txt"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/cuda 2>&1 | tee -a "$out/$tag.txt"
status=${PIPESTATUS[0]}
echo "== figures: python -m bench.gpu --gib 1 --repeat 2 --dir /dev/shm --train-steps 200" | tee -a "$out/$tag.txt"
timeout 240 "$PY" -m bench.gpu --gib 1 --repeat 2 --dir /dev/shm --train-steps 200 --json "$out/$tag.json" 2>&1 \
  | tee -a "$out/$tag.txt" || echo "gpu check: the benchmark did not finish" | tee -a "$out/$tag.txt"
echo "gpu check: $(( $(date +%s) - start )) s; correctness exit code $status; results in $out/$tag.txt" | tee -a "$out/$tag.txt"
exit "$status"
