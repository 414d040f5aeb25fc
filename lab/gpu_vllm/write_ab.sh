#!/usr/bin/env bash
# Issue #38: the one-token write before and after a change, device time, one GPU call (~2 min).
#   here:   git archive REV packages/oscar-kernels/src | tar -x -C lab/gpu_vllm/before   (e.g. REV=e1b9bdb:
#           the write's feedback loop with 10 block barriers per coordinate)
#   device: bash lab/gpu_vllm/write_ab.sh        (carry ["lab/gpu_vllm/before"]: git ignores it)
# Writes $OUT/write_before.json, $OUT/write_after.json (kernel_speed.py --only write each) and prints
# both versions' µs per write, the kernels' device µs and whether the caches are bitwise the same.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/write-ab}"
mkdir -p "$OUT"
B=lab/gpu_vllm/before/packages/oscar-kernels/src
[[ -d "$B/oscar_kernels" ]] || { echo "no $B: run the git archive line above here first" >&2; exit 3; }
export PYTHONUNBUFFERED=1
for which in before after; do
    src=packages/oscar-kernels/src
    [[ $which == before ]] && src=$B
    PYTHONPATH="packages/oscar-math/src:$src" timeout 240 python3 lab/gpu_vllm/kernel_speed.py --only write \
        --out "$OUT/$which" >"$OUT/write_$which.log" 2>&1
    cp "$OUT/$which/kernel_speed.json" "$OUT/write_$which.json" 2>/dev/null
    echo "[$which rc=$?]"; grep '^write' "$OUT/write_$which.log"
done
python3 - "$OUT" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/write_{w}.json"))["write"] for w in ("before", "after"))
for x, y in zip(a, b):
    print(f"{x['tokens']:>3} tokens: {x['us']} -> {y['us']} us ({x['us'] / max(y['us'], 1e-9):.2f}x), "
          f"bitwise {'same' if x['cache_sha256'] == y['cache_sha256'] else 'DIFFERENT'}; "
          f"kernels {x.get('kernels')} -> {y.get('kernels')}")
PY
