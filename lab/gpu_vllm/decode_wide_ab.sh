#!/usr/bin/env bash
# Issue #38: the 2k decode under a 40k-wide block table (the engine suite's) and under a 2k-wide
# one, before (lab/gpu_vllm/before, see write_ab.sh) and after, one GPU call (~2 min).
# Writes $OUT/wide_{before,after}.json and prints the op's µs and its kernels' device µs.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/wide-ab}"
mkdir -p "$OUT"
B=lab/gpu_vllm/before/packages/oscar-kernels/src
[[ -d "$B/oscar_kernels" ]] || { echo "no $B: see write_ab.sh" >&2; exit 3; }
export PYTHONUNBUFFERED=1
for which in before after; do
    src=packages/oscar-kernels/src
    [[ $which == before ]] && src=$B
    PYTHONPATH="packages/oscar-math/src:$src" timeout 200 python3 lab/gpu_vllm/kernel_speed.py --only wide \
        --out "$OUT/wide_$which" >"$OUT/wide_$which.log" 2>&1
    echo "[$which rc=$?]"
    cp "$OUT/wide_$which/kernel_speed.json" "$OUT/wide_$which.json" 2>/dev/null
done
python3 - "$OUT" <<'PY'
import json, sys
for w in ("before", "after"):
    try:
        rows = json.load(open(f"{sys.argv[1]}/wide_{w}.json"))["decode"]
    except OSError:
        print(w, "no result"); continue
    for r in rows:
        k = {n.split("_kernel")[0]: v for n, v in (r.get("kernels_pdl") or {}).items()}
        print(f"{w:6} table {r['table_tokens']:>6}: op {r['op_us']} us (v1 {r['op_v1_us']}, no PDL {r['op_nopdl_us']}), "
              f"partials {r['partials']}, kernels {k}")
PY
