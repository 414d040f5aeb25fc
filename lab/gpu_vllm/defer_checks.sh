#!/usr/bin/env bash
# Issue #38, 2026-12-07 (eleventh session): one device call (no vLLM; ~6 min, timeout 560): the
# decode write's INT2 pass and the window records left open past their layer in a FULL graph
# (serving.run_layer's defer_join, serving.beside, oscar_vllm.backend.join_later) —
#   * the overlap tests on the GPU (both CUDA-graph cases) and the settings;
#   * a planted bug that only a GPU shows: run_layer no longer joins an earlier layer's pass;
#   * step_ablation.py with its ``deferred`` variant (the write + records beside, joined a layer later).
#   device: OUT=$OUT bash lab/gpu_vllm/defer_checks.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/defer-checks}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ROOT=$PWD
T=packages/oscar-kernels/tests
source lab/gpu_vllm/lib.sh
export PYTHONPATH=$ROOT/packages/oscar-math/src:$ROOT/packages/oscar-kernels/src
run_tests overlap 150 "$T/test_serving_overlap.py" "$T/test_serving_settings.py" -rs
echo "== plant: no join of an earlier layer's pass"
rm -rf /tmp/plant && mkdir -p /tmp/plant && cp -r packages/oscar-kernels /tmp/plant/
sed -i 's/^    if plan.side:  # an earlier layer/    if False:  # an earlier layer/' \
    /tmp/plant/oscar-kernels/src/oscar_kernels/serving/run.py
grep -c "if False:  # an earlier layer" /tmp/plant/oscar-kernels/src/oscar_kernels/serving/run.py
(cd /tmp/plant/oscar-kernels && PYTHONPATH=$ROOT/packages/oscar-math/src:/tmp/plant/oscar-kernels/src \
    timeout 120 "${PYT[@]}" tests/test_serving_overlap.py -k "stay_open" >"$OUT/plant_tests.log" 2>&1
    echo "[plant rc=$? (must be 1)] $(tail -1 "$OUT/plant_tests.log")")
echo "== step_ablation"
timeout 300 python3 lab/gpu_vllm/step_ablation.py --out "$OUT" >"$OUT/step_ablation.log" 2>&1
echo "[rc=$?]"; tail -4 "$OUT/step_ablation.log" | cut -c1-1500
