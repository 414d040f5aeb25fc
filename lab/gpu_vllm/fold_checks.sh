#!/usr/bin/env bash
# Issue #38, 2026-12-07: one device call (~5 min, timeout 360; no vLLM): the GPU tests of R_V folded
# into o_proj (ExpandedParams.rotated_output: decode tl + Gluon, extend, ops) and of the write file;
# the decode op with and without the fold (kernel_speed.py decode and wide: op_us vs op_folded_us);
# the write before/after the off-chain picks (ab.sh write; before = the tree's HEAD:
#   here: rm -rf lab/gpu_vllm/before && git archive HEAD packages/oscar-kernels/src | tar -x -C lab/gpu_vllm/before
#   device: OUT=$OUT bash lab/gpu_vllm/fold_checks.sh   (carry ["lab/gpu_vllm/before"])
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/fold-checks}"
mkdir -p "$OUT"
export PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src PYTHONUNBUFFERED=1
T=packages/oscar-kernels/tests
source lab/gpu_vllm/lib.sh  # run_tests
run_tests fold 90 "$T/test_fold.py" "$T/test_ops.py"
run_tests write 100 "$T/test_paged_write.py" -k "exact or layout or matches"
OUT=$OUT bash lab/gpu_vllm/ab.sh write
timeout 130 python3 lab/gpu_vllm/kernel_speed.py --only decode --out "$OUT/decode" >"$OUT/decode.log" 2>&1
echo "[decode rc=$?]"; cp "$OUT/decode/kernel_speed.json" "$OUT/decode_speed.json" 2>/dev/null
python3 - "$OUT/decode_speed.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["decode"]
except OSError:
    sys.exit("no decode result")
for r in rows:
    k = {n.split("_kernel")[0]: v for n, v in (r.get("kernels_pdl_folded") or {}).items()}
    print(f"{r['batch']} x {r['ctx']}: op {r['op_us']} us, folded {r.get('op_folded_us')} us "
          f"({r['op_us'] / max(r.get('op_folded_us') or 1e9, 1e-9):.2f}x); folded kernels {k}")
PY
