#!/usr/bin/env bash
# Issue #38, one device call (no vLLM needed; ~9 min, timeout 590): the 2026-12-06 kernels on the GPU.
#   bash lab/gpu_vllm/prefill_kernels.sh      (SKIP_WARMUP=1: without part 4, ~2.5 min less)
# Writes under $OUT: tests.log, prefill_speed.json/.log, extend_split.json/.log, warmup_phases.json/.log
# (7 files; a device call brings back 8).
#   1. their tests on the GPU (merge + un-rotation, near rows, window records, batched restores,
#      the extend kernel's 3xTF32 RoPE term, dense extend with the row-offset compile check);
#   2. lab/gpu_vllm/prefill_speed.py: each new launch against its torch form, outputs compared;
#   3. the extend kernel without / with the pre-RoPE term (H100, 12-06: 13.3 / 25.3 ms before the
#      term's spills were removed);
#   4. the start-up warm-up: dry runs vs real steps, empty Triton cache, warm cache in a new process,
#      and the steps the first chose (lab/kernel_studies/warmup_phases.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/prefill-kernels}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src PYTHONUNBUFFERED=1
T=packages/oscar-kernels/tests
timeout 220 python3 -m pytest -q -p no:cacheprovider -p no:warnings "$T/test_extend_dense.py" \
    "$T/test_window_records.py" "$T/test_window_restore.py" "$T/test_rotate.py" \
    "$T/test_rope_mean_attention.py" "$T/test_extend_attention.py" >"$OUT/tests.log" 2>&1
echo "[tests rc=$?] $(tail -1 "$OUT/tests.log")"
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
timeout 100 python3 lab/gpu_vllm/prefill_speed.py --out "$OUT" 2>&1 | tee "$OUT/prefill_speed.log" | tail -25
timeout 80 python3 lab/kernel_studies/extend_split.py --quick --shapes 100000,48,16 100000,48,16,0,4,1 \
    --out "$OUT" 2>&1 | tee "$OUT/extend_split.log" | tail -12
[[ "${SKIP_WARMUP:-0}" == 1 ]] && exit 0  # the engine run's warm-up log line answers it too
PYTHONPATH="$PYTHONPATH:packages/oscar-vllm/src" timeout 150 python3 lab/kernel_studies/warmup_phases.py \
    --out "$OUT" --timeout 140 2>&1 | tee "$OUT/warmup_phases.log" | tail -4
rm -f "$OUT/warmup_chosen.json"
