#!/usr/bin/env bash
# Issue #38, one device call (no vLLM needed; ~4 min): the 2026-12-06 prefill-glue kernels on the GPU.
#   bash lab/gpu_vllm/prefill_kernels.sh
# Writes under $OUT: tests.log, prefill_speed.json/.log, extend_split.log.
#   1. their tests on the GPU (merge + un-rotation, near rows, window records, batched restores,
#      the extend kernel's 3xTF32 RoPE term, dense extend with the row-offset compile check);
#   2. lab/gpu_vllm/prefill_speed.py: each new launch against its torch form, outputs compared;
#   3. the extend kernel without / with the pre-RoPE term (before: 13.7 / 38.5 ms on the H200).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/prefill-kernels}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src PYTHONUNBUFFERED=1
T=packages/oscar-kernels/tests
timeout 180 python3 -m pytest -q -p no:cacheprovider -p no:warnings "$T/test_extend_dense.py" \
    "$T/test_window_records.py" "$T/test_window_restore.py" "$T/test_rotate.py" \
    "$T/test_rope_mean_attention.py" >"$OUT/tests.log" 2>&1
echo "[tests rc=$?] $(tail -1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
timeout 120 python3 lab/gpu_vllm/prefill_speed.py --out "$OUT" 2>&1 | tee "$OUT/prefill_speed.log" | tail -25
timeout 90 python3 lab/kernel_studies/extend_split.py --quick --shapes 100000,48,16 100000,48,16,0,4,1 \
    --out "$OUT" 2>&1 | tee "$OUT/extend_split.log" | tail -12
