"""Split-count sweep of the Gluon decode op, PDL on/off, and where a short step's time goes.

Graph-replay times (µs) of ``decode_attention`` per explicit ``num_splits`` at batch 1, 8
and 32 (Qwen3-8B attention shape, random cache as in ``gpu_run.py``), the default split
count with programmatic dependent launch on and off (``USE_PDL``), and at batch 1 the
parts of one step timed alone: query rotation, split + merge kernels, the merge alone, an
empty graph node.
The data behind :func:`oscar_kernels.choose_num_splits` (docs/performance.md).

Usage (repo root, GPU machine)::

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python packages/oscar-kernels/benchmarks/decode_sweep.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu_run as G  # noqa: E402
from timing import bench_graph_ms  # noqa: E402

import oscar_kernels as ok  # noqa: E402

dec = sys.modules["oscar_kernels.decode_attention"]

SPLITS = {  # around the defaults (the first session's sweep: docs/performance.md)
    1: (33, 48, 66, 99, 132, 165, 198),
    8: (16, 24, 33, 66, 99),
    32: (4, 6, 9, 12, 33),
}


def us(fn) -> float:
    return round(1e3 * bench_graph_ms(fn), 2)


def parts(s, ns):
    """Graph µs of each part of one step at ``ns`` splits (the op's three launches alone)."""
    from oscar_kernels.kernels.attention import merge_splits_kernel
    from oscar_kernels.kernels.attention_gluon import window_programs

    q, cache, ep, bt, sl, ws = s["q"], s["cache"], s["ep"], s["bt"], s["sl"], s["ws"]
    d, g = s["d"], s["g"]
    lo = cache.layout
    out = {"rotate": us(lambda: dec._rotate_queries_triton(q, ep))}
    sc = 1 / math.sqrt(d)
    out["split+merge"] = us(
        lambda: dec._launch_decode(s["q_rot"], cache, bt, sl, ws, sc, g, ns, 32, 1, 2, impl="gluon")
    )
    nt = ns + window_programs(lo.sink_tokens, lo.recent_tokens)
    bsz, hq = q.shape[:2]
    po = torch.randn(bsz, hq, nt, d, device=G.DEV)
    plse = torch.randn(bsz, hq, nt, device=G.DEV)
    o = torch.empty(bsz, hq, d, device=G.DEV, dtype=torch.bfloat16)
    rot = ep.v_rotation
    ch = min(64, 1 << (nt - 1).bit_length())
    out["merge"] = us(
        lambda: merge_splits_kernel[(bsz * hq,)](
            po, plse, o, rot, *rot.stride(), nt, hq, g, HEAD_DIM=d, CH=ch, ROTATE=True, RC=32
        )
    )
    z = torch.zeros(1, device=G.DEV)
    out["empty_node"] = us(lambda: z.add_(1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"triton": __import__("triton").__version__, "rows": []}
    t = time.time()
    shapes = [(c, b) for b in (1, 8, 32) for c in (8192, 32768, 131072)]
    for ctx, bsz in shapes:
        try:
            row = sweep_shape(ctx, bsz)
        except Exception:  # one broken shape must not cost the device call
            row = {"ctx": ctx, "batch": bsz, "error": traceback.format_exc()[-2000:]}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        torch.cuda.empty_cache()
        json.dump(res, open(os.path.join(a.out, "decode_sweep.json"), "w"), indent=1)
    print(f"sweep {time.time() - t:.0f}s", flush=True)


def sweep_shape(ctx: int, bsz: int) -> dict:
    s = G._int2_decode_setup(ctx, bsz)
    args = (s["q"], s["cache"], s["ep"], s["bt"], s["sl"], s["ws"])
    row = {"ctx": ctx, "batch": bsz, "splits": {}}
    _, bn, _, pps = dec.resolve_launch(s["cache"], s["q"], "gluon")
    row["default_splits"] = ok.choose_num_splits(bsz, 8, ctx, G.DEV, bn, pps)
    row["default_us"] = us(lambda a=args: ok.decode_attention(*a, impl="gluon"))
    dec.USE_PDL = False
    row["default_no_pdl_us"] = us(lambda a=args: ok.decode_attention(*a, impl="gluon"))
    dec.USE_PDL = True
    for ns in SPLITS[bsz]:
        row["splits"][ns] = us(lambda a=args, ns=ns: ok.decode_attention(*a, impl="gluon", num_splits=ns))
    best = row["default_splits"]
    kern = dec.LAST_COMPILED.get("decode_split")
    row["regs_spills"] = [getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)]
    if bsz == 1:
        row["parts_at_default"] = parts(s, best)
    return row


if __name__ == "__main__":
    main()
