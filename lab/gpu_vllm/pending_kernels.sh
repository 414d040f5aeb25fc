#!/usr/bin/env bash
# One device call (no vLLM needed), for the next session, with `gpu_engine.sh stash 1` in front:
#   device call:  bash packages/oscar-vllm/benchmarks/gpu_engine.sh stash 1 && bash lab/gpu_vllm/pending_kernels.sh
# then stash 2..4 back to back and the engine run:
#   gpu_engine.sh run --only qwen-oscar-cache,qwen-bf16-fa3 --smol "" --capture-sizes 1,2,4,8,16,32,48,64 \
#       --budget-s 585 --case-timeout 420     # jit_compiles must be [] (the row-offset fix), shared hits
# Writes under $OUT. Kept under ~150 s: the engine calls must follow while the machine is warm.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/pending}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src:packages/oscar-vllm/src
# 1. the row-offset compile check and the extend tests with the pre-RoPE term on the GPU
timeout 100 python3 -m pytest -q -p no:cacheprovider -p no:warnings packages/oscar-kernels/tests/test_extend_dense.py \
    -k "row_offset or far_rows" >"$OUT/extend_dense_tests.log" 2>&1
tail -2 "$OUT/extend_dense_tests.log"
# 2. the extend kernel with the pre-RoPE term, 48 hits over 100k: tiles of 64 / 32 keys, 4 / 8 warps
#    (ptxas for sm_90: 64 keys on 4 warps spill 316 bytes, 32 keys none; 2026-12-04 third session)
timeout 120 python3 lab/kernel_studies/extend_split.py --out "$OUT" --rep-ms 30 --quick --shapes \
    100000,48,48,0,4,1,64 100000,48,48,0,8,1,64 100000,48,48,0,4,1,32 100000,48,48,0,4,0,32 100000,48,48,0,4,0,64
