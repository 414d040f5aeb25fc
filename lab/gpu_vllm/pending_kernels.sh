#!/usr/bin/env bash
# One device call (no vLLM needed): kernel-level GPU checks and measurements of the decode write with
# K and V in one launch (paged_write_kv_kernel). Writes under $OUT. Run first in the session of
# 2026-12-04 (third), together with `gpu_engine.sh stash 1`:
#   device call:  bash packages/oscar-vllm/benchmarks/gpu_engine.sh stash 1 && bash lab/gpu_vllm/pending_kernels.sh
# then stash 2..4 and the engine run (docs/vllm.md, the session's section).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/pending}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src:packages/oscar-vllm/src
# 1. the write tests (fused and two-launch paths, tf32 and fp32) and the warm-up's compile check
timeout 200 python3 -m pytest -q -p no:cacheprovider -p no:warnings packages/oscar-kernels/tests/test_paged_write.py \
    packages/oscar-kernels/tests/test_write_rope.py packages/oscar-kernels/tests/test_write_windows.py \
    >"$OUT/write_tests.log" 2>&1
tail -2 "$OUT/write_tests.log"
timeout 90 python3 -m pytest -q -p no:cacheprovider -p no:warnings packages/oscar-vllm/tests/test_warmup.py \
    -k "cuda" >"$OUT/warmup_tests.log" 2>&1
tail -2 "$OUT/warmup_tests.log"
# 2. the decode write: one launch for K and V against two, in a graph, 1..64 tokens, with the pre-RoPE mean
timeout 150 python3 packages/oscar-kernels/benchmarks/write_speed.py --decode --tokens 1 8 32 64 --block-t 0 \
    --rope --graph --fuse on off --only plain plain+rope --out "$OUT/write_decode_fused.json" 2>&1 | tail -20
