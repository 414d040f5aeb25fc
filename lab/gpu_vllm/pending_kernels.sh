#!/usr/bin/env bash
# One device call (no vLLM needed): the GPU checks and measurements that 2026-12-04 left for the next
# session, in order of what they decide. Writes under $OUT (or /tmp/pending).
#   device call:  bash lab/gpu_vllm/pending_kernels.sh
# Then, with vLLM stashed (packages/oscar-vllm/benchmarks/gpu_engine.sh stash 1..4):
#   gpu_engine.sh run --only qwen-oscar-cache,qwen-oscar-cache-nosplit,qwen-bf16-fa3 --smol "" \
#       --capture-sizes 1,2,4,8,16,32,48,64      # hits with GQA rows + splits; jit_compiles after the warm-up
#   gpu_engine.sh run --only smol-oscar-preempt,smol-oscar-many-roomy   # vLLM's counter must be > 0
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/pending}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src:packages/oscar-vllm/src
# 1. the extend kernel with the split count at run time: correctness, one compile key, the engine's shape
#    (each package's tests in its own pytest run: their conftest modules share a name)
timeout 120 python3 -m pytest -q -p no:cacheprovider -p no:warnings \
    packages/oscar-kernels/tests/test_extend_attention.py packages/oscar-kernels/tests/test_chunk_invariance.py \
    >"$OUT/kernel_tests.log" 2>&1
tail -2 "$OUT/kernel_tests.log"
timeout 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings packages/oscar-vllm/tests/test_warmup.py \
    -k "cuda or split_tails" >"$OUT/warmup_tests.log" 2>&1
tail -2 "$OUT/warmup_tests.log"
# 2. the op: unsplit vs split, against torch's flash SDPA on a BF16 cache in the same run
timeout 150 python3 lab/kernel_studies/extend_split.py --out "$OUT" 2>&1 | tail -6
# 3. the decode step's write (72 launches a step at the Qwen3-8B shape, ~11 us each in the engine):
#    tile and warps for 1, 8 and 64 tokens, with and without the pre-RoPE key mean
timeout 120 python3 packages/oscar-kernels/benchmarks/write_speed.py --decode --tokens 1 8 64 --block-t 0 16 \
    --warps 0 2 8 --rope --graph --only plain plain+rope --out "$OUT/write_decode.json" 2>&1 | tail -40
