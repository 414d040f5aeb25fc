#!/usr/bin/env bash
# One device call (no vLLM needed): the GPU checks and measurements that the night of 2026-12-03
# left for the next session, in order of what decides a default. Writes under $OUT (or /tmp/pending).
#   device call:  bash lab/gpu_vllm/pending_kernels.sh
# Then, with vLLM stashed (packages/oscar-vllm/benchmarks/gpu_engine.sh stash 1..4):
#   gpu_engine.sh run --only smol-oscar-eager-cache,smol-oscar-eager-cache-warm --budget-s 400 --case-timeout 190
#   gpu_engine.sh run --only qwen-oscar-cache-split,qwen-oscar-cache-warm --smol "" --capture-sizes 1,2,4,8,16,32,48,64
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/pending}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src:packages/oscar-vllm/src
# 1. the split extend on the GPU: correctness at the engine's shape, the op's speed unsplit vs split
timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    packages/oscar-kernels/tests/test_extend_attention.py packages/oscar-vllm/tests/test_warmup.py \
    >"$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
timeout 150 python3 lab/kernel_studies/extend_split.py --out "$OUT" 2>&1 | tail -8
# 2. the warm-up's cost with an empty Triton cache, and that serving then compiles nothing
timeout 240 python3 lab/kernel_studies/warmup_cost.py --out "$OUT" 2>&1 | tail -4
