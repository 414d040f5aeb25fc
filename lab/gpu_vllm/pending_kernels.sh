#!/usr/bin/env bash
# One device call (no vLLM needed): kernel-level GPU checks and measurements. Run by the second
# session of 2026-12-04 (results in lab/gpu_vllm/results/h200_2026-12-04b/). Writes under $OUT.
#   device call:  bash lab/gpu_vllm/pending_kernels.sh
# Next, with vLLM stashed (packages/oscar-vllm/benchmarks/gpu_engine.sh stash 1..4, back to back):
#   gpu_engine.sh run --only qwen-oscar-cache,qwen-bf16-fa3 --smol "" --capture-sizes 1,2,4,8,16,32,48,64
#       # prefill of 32k with the far-rows kernel (estimate ~1.18x FA3), and hits_profile_100000x48:
#       # where a prefix hit's 169 ms go (the extend op is ~10 ms of it)
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
