#!/usr/bin/env bash
# Issue #38: one kernel_speed.py case before and after a change, device time, one GPU call (~2 min).
#   here:   git archive REV packages/oscar-kernels/src | tar -x -C lab/gpu_vllm/before   (e.g. REV=e1b9bdb)
#   device: bash lab/gpu_vllm/ab.sh write|wide|records|decode     (carry ["lab/gpu_vllm/before"]: git ignores it)
# write: the one-token write (µs per write, the kernels' device µs warm and after an L2 flush, bitwise-equal caches);
# records: a decode step's window-record write for 1, 8 and 144 sequences (the same, bitwise-equal pages);
# wide:  the 2k decode under a 40k-wide block table (the engine suite's) and under a 2k-wide one;
# decode: the decode op at 1 x 2k, 1 x 130k and 8 x 32k (kernel_speed.py's shapes).
# Writes $OUT/<kind>_before.json, $OUT/<kind>_after.json and prints the comparison.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
KIND="${1:?usage: ab.sh write|wide|records|decode}"
OUT="${OUT:-/tmp/kernel-ab}"
mkdir -p "$OUT"
B=lab/gpu_vllm/before/packages/oscar-kernels/src
[[ -d "$B/oscar_kernels" ]] || { echo "no $B: run the git archive line above here first" >&2; exit 3; }
export PYTHONUNBUFFERED=1
for which in before after; do
    src=packages/oscar-kernels/src
    [[ $which == before ]] && src=$B
    PYTHONPATH="packages/oscar-math/src:$src" timeout 240 python3 lab/gpu_vllm/kernel_speed.py --only "$KIND" \
        --out "$OUT/${KIND}_$which" >"$OUT/${KIND}_$which.log" 2>&1
    echo "[$which rc=$?]"
    cp "$OUT/${KIND}_$which/kernel_speed.json" "$OUT/${KIND}_$which.json" 2>/dev/null
done
python3 - "$OUT" "$KIND" <<'PY'
import json, sys
out, kind = sys.argv[1], sys.argv[2]
key = kind if kind in ("write", "records") else "decode"
rows = {}
for w in ("before", "after"):
    try:
        rows[w] = json.load(open(f"{out}/{kind}_{w}.json"))[key]
    except OSError:
        print(w, "no result")
if kind in ("write", "records") and len(rows) == 2:
    digest = "cache_sha256" if kind == "write" else "rows_sha256"
    for x, y in zip(rows["before"], rows["after"]):
        whole = f"; after, whole tile: {y['us_whole_tile']} us" if "us_whole_tile" in y else ""
        print(f"{x['tokens']:>3} tokens: {x['us']} -> {y['us']} us ({x['us'] / max(y['us'], 1e-9):.2f}x), "
              f"bitwise {'same' if x[digest] == y[digest] else 'DIFFERENT'}; "
              f"kernels {x.get('kernels')} -> {y.get('kernels')}{whole}; "
              f"L2 flushed: {x.get('kernels_cold_l2')} -> {y.get('kernels_cold_l2')}")
        if kind == "write":
            print(f"    window pass: {x.get('us_window')} -> {y.get('us_window')} us; L2 flushed: "
                  f"{x.get('kernels_window_cold_l2')} -> {y.get('kernels_window_cold_l2')}")
elif kind in ("wide", "decode"):
    # op_folded_us: the engine's op (R_V in o_proj, merge_cols_kernel alone); op_us un-rotates (v1)
    for w, rs in rows.items():
        for r in rs:
            k = {n.split("_kernel")[0]: v for n, v in (r.get("kernels_pdl_folded") or {}).items()}
            print(f"{w:6} {r['ctx']:>6} x {r['batch']:<2} table {r['table_tokens']:>6}: folded op "
                  f"{r.get('op_folded_us')} us, op {r['op_us']} us (no PDL {r['op_nopdl_us']}), "
                  f"partials {r['partials']}, merge alone {r.get('merge_alone_us')} us, kernels {k}")
PY
