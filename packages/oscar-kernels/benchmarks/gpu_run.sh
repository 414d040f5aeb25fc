#!/usr/bin/env bash
# One device call: correctness checks + benchmarks on the H200. Run from the repo root.
set -o pipefail
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/oscar-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia_smi.txt"
python3 packages/oscar-kernels/benchmarks/gpu_run.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/stdout.txt"
