#!/usr/bin/env bash
# Issue #38, 2026-12-07 (tenth session): one device call (no vLLM; ~5 min, timeout 420): the decode
# write beside the attention (serving.run_layer's overlap_write) on the GPU —
#   * its tests: the serving core eagerly and in a CUDA graph with the forked stream, the write's
#     two passes against the one-pass write, the write file, the GPU check's graph case;
#   * step_ablation.py with its ``overlap`` variant (what the write costs a step when beside).
#   device: OUT=$OUT bash lab/gpu_vllm/overlap_checks.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/overlap-checks}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src:packages/oscar-vllm/src PYTHONUNBUFFERED=1
T=packages/oscar-kernels/tests
source lab/gpu_vllm/lib.sh
run_tests overlap 60 "$T/test_serving_overlap.py" "$T/test_serving_settings.py"
run_tests two_passes 60 "$T/test_write_rope.py" -k "two_passes or exact_with_constant"
run_tests write 60 "$T/test_paged_write.py" -k "exact or chunk or matches_reference"
timeout 90 python3 packages/oscar-vllm/benchmarks/gpu_check.py --out "$OUT/gpu_check.json" >"$OUT/gpu_check.log" 2>&1
echo "[gpu_check rc=$?] $(tail -2 "$OUT/gpu_check.log" | tr '\n' ' ' | cut -c1-400)"
echo "== step_ablation"
timeout 230 python3 lab/gpu_vllm/step_ablation.py --out "$OUT" >"$OUT/step_ablation.log" 2>&1
echo "[rc=$?]"; tail -4 "$OUT/step_ablation.log" | cut -c1-1100
