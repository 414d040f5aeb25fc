#!/usr/bin/env bash
# Issue #40 on the GPU (no vLLM needed): the serving core's per-layer host cost (validated ops vs
# plan + run_layer, Qwen3-8B attention shape) and the vLLM backend's per-step calls against the torch
# reference (benchmarks/gpu_check.py drives plan_step / run_layer with vLLM-shaped tensors), plus the
# extend and write kernel tests after the launchers' plan/run split. Results under $OUT (or $1).
#   bash lab/gpu_vllm/core_check.sh [OUT_DIR]       # ~5 min on an H100
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${1:-${OUT:-/tmp/core}}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src:packages/oscar-vllm/src PYTHONUNBUFFERED=1
for path in ops plan; do
    for shape in "1 2048" "8 32768"; do
        set -- $shape
        timeout 90 python3 lab/kernel_studies/host_cost.py --gpu --path "$path" --batch "$1" --ctx "$2" \
            --iters 300 --json "$OUT/host_cost.jsonl" 2>&1 | OSCAR_TOP=12 head -30
    done
done
timeout 240 python3 packages/oscar-vllm/benchmarks/gpu_check.py --out "$OUT/gpu_check.json" >"$OUT/gpu_check.log" 2>&1
echo "[gpu_check rc=$?] $(tail -2 "$OUT/gpu_check.log" | tr '\n' ' ')"
timeout 120 python3 -m pytest -q -x -p no:cacheprovider -p no:warnings packages/oscar-kernels/tests/test_extend_attention.py \
    packages/oscar-kernels/tests/test_paged_write.py >"$OUT/kernel_tests.log" 2>&1
echo "[extend+write tests rc=$?] $(tail -1 "$OUT/kernel_tests.log")"
