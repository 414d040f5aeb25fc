#!/usr/bin/env bash
# Issue #38, 2026-12-07 (tenth session): one device call (no vLLM; ~7 min, timeout 560):
#   * GPU tests of the ninth session's kernel changes (window records' compile-time geometry, the
#     write's wide feedback chunk) beside the write's and the records' whole files;
#   * ab.sh records and ab.sh write (before = 0da43db, the engine run of 2026-12-07):
#       here: rm -rf lab/gpu_vllm/before && mkdir -p lab/gpu_vllm/before &&
#             git archive 0da43db packages/oscar-kernels/src | tar -x -C lab/gpu_vllm/before
#   * step_ablation.py: what the write, the decode op and the records each add to a 36-layer step
#     whose layers stream 390 MB of weights (L2 cold as in the engine).
#   device: OUT=$OUT bash lab/gpu_vllm/step_checks.sh      (carry ["lab/gpu_vllm/before"])
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/step-checks}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src PYTHONUNBUFFERED=1
T=packages/oscar-kernels/tests
source lab/gpu_vllm/lib.sh
run_tests records 60 "$T/test_window_records.py" "$T/test_write_windows.py"
run_tests write 120 "$T/test_paged_write.py"
for kind in records write; do
    echo "== ab.sh $kind"
    OUT="$OUT/ab" timeout 150 bash lab/gpu_vllm/ab.sh "$kind" 2>&1 | tail -5
done
echo "== step_ablation"
timeout 200 python3 lab/gpu_vllm/step_ablation.py --out "$OUT" >"$OUT/step_ablation.log" 2>&1
echo "[rc=$?]"; tail -4 "$OUT/step_ablation.log" | cut -c1-900
