#!/usr/bin/env bash
# Issue #38, one device call (no vLLM needed; H100; at most ~245 s, give it timeout 300):
#   bash lab/gpu_vllm/pending_kernels.sh
# Writes under $OUT: *_tests.log, kernel_speed.json, kernel_speed.log.
#   1. kernel tests on the GPU: the row-offset compile check (now keyed per offset, by OSCAR's and
#      Triton's own binder), the write's feedback exactness (the per-quarter loop), decode, rotate;
#   2. lab/gpu_vllm/kernel_speed.py: the one-token write before/after (bitwise_equal must be true),
#      and decode at 1 x 2k, 1 x 130k, 8 x 32k: op with/without PDL, per-kernel profile, the merge
#      alone, SDPA BF16 of the same run, bytes, TB/s and % of 3.35 TB/s.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/pending}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src
T=packages/oscar-kernels/tests
PYT=(python3 -m pytest -q -x -p no:cacheprovider -p no:warnings)
source lab/gpu_vllm/lib.sh  # run_tests (the cwd is the repository root)
run_tests extend_row_offset 30 "$T/test_extend_dense.py" -k "row_offset"
run_tests write_feedback 30 "$T/test_paged_write.py" -k "feedback"
run_tests rotate 20 "$T/test_rotate.py"
run_tests decode 45 "$T/test_decode_attention.py"
# 2. timings (the write first: its cases are short; each case is saved as it finishes)
timeout 120 python3 lab/gpu_vllm/kernel_speed.py --out "$OUT" 2>&1 | tee "$OUT/kernel_speed.log" | grep -v "^ *File\|^Traceback" | tail -30
