"""A/B sweep of the Gluon decode op's launch knobs, split counts, and where a short step's time goes.

Graph-replay times (µs) of ``decode_attention`` at batch 1 and 8 (Qwen3-8B attention shape,
random cache as in ``gpu_run.py``) for each entry of :data:`CONFIGS` at the default split
count, per explicit ``num_splits`` with the early/preload knobs on, SDPA BF16 in the same
run, and at 8k x 1 the parts of one step timed alone: query rotation, split + merge kernels,
the merge alone, an empty graph node (docs/performance.md). ``--ring``: only the A/B of
the ``cp.async`` ring (:data:`RING_VARIANTS`: off, 2 / 3 / 4 stages, 16- or 4-8-byte copies, by
rule, with the rotation in 16-output programs) at all nine shapes.

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
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
# gpu_run and timing stay with the product benchmarks
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../packages/oscar-kernels/benchmarks"))
import gpu_run as G  # noqa: E402
from timing import bench_graph_ms  # noqa: E402

import oscar_kernels as ok  # noqa: E402

dec = sys.modules["oscar_kernels.decode_attention"]

#: launch knobs of ``decode_attention`` compared at each shape's default split count (A/B in one
#: run): the merge's rotation preload, window programs of 64 or 32 tokens, the query rotation in
#: one program per row (0) or per 32 / 16 outputs
CONFIGS = {
    "session2": dict(MERGE_PRELOAD_MAX_D=0, WINDOW_TOKENS=64, ROTATE_ROWS_PER_PROGRAM=0),
    "preload": dict(MERGE_PRELOAD_MAX_D=128, WINDOW_TOKENS=64, ROTATE_ROWS_PER_PROGRAM=0),
    "preload+w32": dict(MERGE_PRELOAD_MAX_D=128, WINDOW_TOKENS=32, ROTATE_ROWS_PER_PROGRAM=0),
    "preload+w32+rot32": dict(MERGE_PRELOAD_MAX_D=128, WINDOW_TOKENS=32, ROTATE_ROWS_PER_PROGRAM=32),
    "preload+w32+rot16": dict(MERGE_PRELOAD_MAX_D=128, WINDOW_TOKENS=32, ROTATE_ROWS_PER_PROGRAM=16),
}

SPLITS = {1: (33, 66, 99, 132, 198), 8: (16, 24, 33, 66)}  # swept with the defaults


def set_knobs(knobs: dict) -> None:
    """The knobs (names as in the old module globals) as the decode op's default launch rules."""
    dec.DEFAULT_TUNING = replace(dec.DEFAULT_TUNING, **{k.lower(): v for k, v in knobs.items()})


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
    per_row = replace(dec.DEFAULT_TUNING, rotate_rows_per_program=0)
    out["rotate_one_program_per_row"] = us(lambda: dec._rotate_queries_triton(q, ep, per_row))
    sc = 1 / math.sqrt(d)
    out["split+merge"] = us(
        lambda: dec._launch_decode(
            s["q_rot"], cache, bt, sl, ws, sc, g, dec.SplitLaunch(ns, 32, 1, 2), impl="gluon"
        )
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
    out["merge_preload"] = us(
        lambda: merge_splits_kernel[(bsz * hq,)](
            po,
            plse,
            o,
            rot,
            *rot.stride(),
            nt,
            hq,
            g,
            HEAD_DIM=d,
            CH=ch,
            ROTATE=True,
            RC=32,
            PRELOAD=True,
            num_warps=8,
        )
    )
    z = torch.zeros(1, device=G.DEV)
    out["empty_node"] = us(lambda: z.add_(1))
    return out


#: ``cp.async`` ring variants (``--ring``): module knobs of ``decode_attention`` per variant; the
#: ring ones force it on for every split length (``ASYNC_MIN_TILES`` 0), ``rule`` is the default
RING_VARIANTS = {
    "plain": dict(ASYNC_STAGES=0),
    "ring3_narrow": dict(ASYNC_STAGES=3, ASYNC_MIN_TILES=0, ASYNC_WIDE_MIN_WAVES=None),
    "ring2": dict(ASYNC_STAGES=2, ASYNC_MIN_TILES=0, ASYNC_WIDE_MIN_WAVES=0),
    "ring3": dict(ASYNC_STAGES=3, ASYNC_MIN_TILES=0, ASYNC_WIDE_MIN_WAVES=0),
    "ring4": dict(ASYNC_STAGES=4, ASYNC_MIN_TILES=0, ASYNC_WIDE_MIN_WAVES=0),
    "rule": {},
    "rule+rot32": dict(ROTATE_ROWS_SMALL=0),
}
RING_KNOBS = (
    "ASYNC_STAGES",
    "ASYNC_MIN_TILES",
    "ASYNC_WIDE_MIN_WAVES",
    "ROTATE_ROWS_PER_PROGRAM",
    "ROTATE_ROWS_SMALL",
)


def sweep_ring(ctx: int, bsz: int) -> dict:
    """Op and split+merge graph µs (and the split+merge bandwidth fraction) of each entry of
    :data:`RING_VARIANTS` at the default split count; at 128k also 64-token tiles with the
    3-stage ring, and at 128k x 8 other split counts; SDPA BF16 of the same shape."""
    s = G._int2_decode_setup(ctx, bsz)
    args = (s["q"], s["cache"], s["ep"], s["bt"], s["sl"], s["ws"])
    ns = ok.choose_num_splits(bsz, 8, ctx, G.DEV, 32, 12)
    lo = s["cache"].layout
    row = {"ctx": ctx, "batch": bsz, "splits": ns}
    per = math.ceil((ctx - lo.window_tokens) / ns)
    row["tiles_per_split"] = math.ceil(per / 32)
    defaults = {k: getattr(dec.DEFAULT_TUNING, k.lower()) for k in RING_KNOBS}

    def kernels(ns=ns, bn=32):
        return dec._launch_decode(
            s["q_rot"], s["cache"], s["bt"], s["sl"], s["ws"], 1 / math.sqrt(s["d"]), s["g"],
            dec.SplitLaunch(ns, bn, 1, 2), impl="gluon",
        )  # fmt: skip

    def measure(key, ns=ns, bn=32, op=True):
        if op:
            row[f"{key}_op_us"] = us(
                lambda: ok.decode_attention(*args, impl="gluon", num_splits=ns, block_n=bn)
            )
        kus = us(lambda: kernels(ns, bn))
        row[f"{key}_kernels_us"] = kus
        row[f"{key}_bw"] = round(s["nbytes"] / (kus * 1e-6) / COPY_BPS, 4)
        kern = dec.LAST_COMPILED.get("decode_split")
        row[f"{key}_regs"] = getattr(kern, "n_regs", None)
        row[f"{key}_ring"] = "cp.async" in kern.asm.get("ptx", "")

    try:
        for name, knobs in RING_VARIANTS.items():
            set_knobs(defaults)
            set_knobs(knobs)
            measure(name, op=True)
        set_knobs(defaults)
        if ctx == 131072 and bsz >= 8:
            set_knobs(RING_VARIANTS["ring3"])
            measure("ring3_bn64", ns=ok.choose_num_splits(bsz, 8, ctx, G.DEV, 64, 12), bn=64)
            if bsz == 8:
                for n2 in (66, 132, 198):
                    measure(f"ring3_ns{n2}", ns=n2, op=False)
    finally:
        set_knobs(defaults)
    s = None
    torch.cuda.empty_cache()
    row["sdpa_us"] = _sdpa_us(bsz, ctx)
    return row


def print_ring_summary(res: dict) -> None:
    """One line per shape: op µs / split+merge bandwidth % of each variant (the reply's tail)."""
    names = list(RING_VARIANTS) + ["ring3_bn64", "ring3_ns66", "ring3_ns132", "ring3_ns198"]
    print("ctx B splits tiles sdpa | " + " | ".join(names))
    for r in res["rows"]:
        if "error" in r:
            print(r["ctx"], r["batch"], "ERROR", r["error"][-300:])
            continue
        cells = []
        for n in names:
            if f"{n}_kernels_us" in r:
                op = r.get(f"{n}_op_us")
                ring = "R" if r.get(f"{n}_ring") else "p"
                cells.append(
                    f"{op if op is not None else '-'}/{r[f'{n}_kernels_us']}/{100 * r[f'{n}_bw']:.1f}{ring}"
                )
            else:
                cells.append("")
        print(r["ctx"], r["batch"], r["splits"], r["tiles_per_split"], r["sdpa_us"], "|", " | ".join(cells))
    regs = {n: r.get(f"{n}_regs") for r in res["rows"][:1] for n in names}
    print("regs (first shape):", regs)


COPY_BPS = 4.27e12  # replaced by the measured copy bandwidth in main()


def _sdpa_us(bsz: int, ctx: int) -> float:
    """The BF16 baseline: torch SDPA over a dense ``[B, 8, ctx, 128]`` cache, 32 query heads."""
    k = torch.randn(bsz, 8, ctx, 128, device=G.DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qs = torch.randn(bsz, 32, 1, 128, device=G.DEV, dtype=torch.bfloat16)
    return us(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True))


def _sweep(fn, shapes, res, path) -> None:  # noqa: ANN001
    """``fn(ctx, batch)`` per shape into ``res["rows"]``, the JSON rewritten after each."""
    for ctx, bsz in shapes:
        try:
            row = fn(ctx, bsz)
        except Exception:  # one broken shape must not cost the device call
            row = {"ctx": ctx, "batch": bsz, "error": traceback.format_exc()[-2000:]}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        torch.cuda.empty_cache()
        json.dump(res, open(path, "w"), indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ring", action="store_true", help="the cp.async ring variants' A/B only")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.ring:
        global COPY_BPS
        COPY_BPS = G.copy_bandwidth_gbs() * 1e9
        res = {"triton": __import__("triton").__version__, "copy_GBps": COPY_BPS / 1e9, "rows": []}
        t = time.time()
        shapes = [(131072, 8), (8192, 1)] + [(c, b) for c in (8192, 32768, 131072) for b in (1, 8, 32)]
        _sweep(sweep_ring, list(dict.fromkeys(shapes)), res, os.path.join(a.out, "decode_ring_sweep.json"))
        print(f"ring sweep {time.time() - t:.0f}s", flush=True)
        print_ring_summary(res)
        return
    res = {"triton": __import__("triton").__version__, "rows": []}
    t = time.time()
    shapes = [(c, b) for b in (1, 8) for c in (8192, 32768, 131072)]
    _sweep(sweep_shape, shapes, res, os.path.join(a.out, "decode_sweep.json"))
    print(f"sweep {time.time() - t:.0f}s", flush=True)


def sweep_shape(ctx: int, bsz: int) -> dict:
    s = G._int2_decode_setup(ctx, bsz)
    args = (s["q"], s["cache"], s["ep"], s["bt"], s["sl"], s["ws"])
    row = {"ctx": ctx, "batch": bsz, "configs": {}, "splits": {}}
    _, bn, _, pps = dec.resolve_launch(s["cache"], s["q"], "gluon")
    bn = dec.gluon_block_n(bsz, s["cache"].layout, ctx, G.DEV, pps)
    row["default_splits"] = ok.choose_num_splits(bsz, 8, ctx, G.DEV, bn, pps)
    defaults = {k: getattr(dec.DEFAULT_TUNING, k.lower()) for k in CONFIGS["session2"]}
    try:
        for name, knobs in CONFIGS.items():
            set_knobs(knobs)
            row["configs"][name] = us(lambda a=args: ok.decode_attention(*a, impl="gluon"))
            kern = dec.LAST_COMPILED.get("decode_split")
            row["configs"][name + "_regs"] = getattr(kern, "n_regs", None)
        set_knobs(defaults)
        for ns in SPLITS.get(bsz, ()):
            row["splits"][ns] = us(lambda a=args, ns=ns: ok.decode_attention(*a, impl="gluon", num_splits=ns))
    finally:
        set_knobs(defaults)
    row["default_us"] = us(lambda a=args: ok.decode_attention(*a, impl="gluon"))
    if bsz == 1 and ctx == 8192:
        row["parts_at_default"] = parts(s, row["default_splits"])
    s = None
    row["sdpa_us"] = _sdpa_us(bsz, ctx)
    return row


if __name__ == "__main__":
    main()
