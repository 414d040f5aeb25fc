"""Decode-op cost of the pre-RoPE key mean's score term: R = 0 vs 8 vs 64 pairs, same run.

Graph-replay µs of ``decode_attention`` (defaults: Gluon kernel, split rule, ring rule) at the
Qwen3-8B attention shape (H_kv 8, GQA 4, d 128, page 64, sink 64 + recent 256) on a random
cache (``gpu_run._int2_decode_setup``), for ``R`` = 0 (no mean: today's kernel), 8 and 64
(all pairs of d = 128, the worst case) pairs with realistic θ = 10000^(-2i/d); per row the
slowdown against ``R = 0`` of the same shape, the compiled split kernel's registers / spills, and
the relative output difference against ``R = 0`` (the term is on: it must change the output).

Usage (repo root, GPU machine)::

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python packages/oscar-kernels/benchmarks/rope_decode_speed.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
# gpu_run and timing stay with the product benchmarks
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../packages/oscar-kernels/benchmarks"))
import gpu_run as G  # noqa: E402
from timing import bench_graph_ms, run_meta  # noqa: E402

import oscar_kernels as ok  # noqa: E402

dec = sys.modules["oscar_kernels.decode_attention"]

SHAPES = ((8192, 1), (32768, 8), (131072, 8))
#: (pairs, knobs of the decode module): R = 8 by the default rule, by angle addition on every
#: tile size and by one angle per element everywhere; R = 64 (one angle per element: the
#: addition's operand would be too large)
CONFIGS = (
    (0, {}),
    (8, {}),
    (8, {"ROPE_ADDITION_MIN_BLOCK_N": 0}),
    (8, {"ROPE_ADDITION_MAX_ELEMENTS": 0}),
    (64, {}),
)


def with_pairs(ep: ok.ExpandedParams, hkv: int, d: int, pairs: int, gen: torch.Generator):
    """``ep`` with a pre-RoPE mean on the ``pairs`` lowest-frequency pairs (0: none)."""
    if pairs == 0:
        return ep
    half = d // 2
    sel = torch.arange(half - pairs, half)
    m = torch.zeros(hkv, d)
    m[:, sel] = 3 * torch.randn(hkv, pairs, generator=gen)
    m[:, sel + half] = 3 * torch.randn(hkv, pairs, generator=gen)
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rk, rv = ep.k_rotation[0].cpu(), ep.v_rotation[0].cpu()
    lqp = ok.LayerQuantParams(rk, rv, k_rope_mean=m, k_rope_inv_freq=inv)
    rope = lqp.expand(hkv, d, ep.k_rotation.device)
    return dataclasses.replace(
        ep, **{f.name: getattr(rope, f.name) for f in dataclasses.fields(rope) if f.name.startswith("k_rope")}
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rep-ms", type=int, default=200)
    ap.add_argument(
        "--pairs", type=int, nargs="+", default=None, help="R values with the default rule (default: CONFIGS)"
    )
    a = ap.parse_args()
    configs = CONFIGS if a.pairs is None else tuple((p, {}) for p in dict.fromkeys([0, *a.pairs]))
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for ctx, bsz in SHAPES:
        s = G._int2_decode_setup(ctx, bsz)
        gen = torch.Generator().manual_seed(ctx)
        base_out = None
        for pairs, knobs in configs:
            saved = dec.DEFAULT_TUNING
            dec.DEFAULT_TUNING = replace(saved, **{k.lower(): v for k, v in knobs.items()})
            row = dict(ctx=ctx, batch=bsz, pairs=pairs, knobs=knobs)
            try:
                ep = with_pairs(s["ep"], 8, 128, pairs, gen)
                q, cache, bt, sl, ws = s["q"], s["cache"], s["bt"], s["sl"], s["ws"]

                def fn(ep=ep, q=q, cache=cache, bt=bt, sl=sl, ws=ws):
                    return ok.decode_attention(q, cache, ep, bt, sl, ws)

                out = fn()
                torch.cuda.synchronize()
                kern = dec.LAST_COMPILED["decode_split"]
                ptx = kern.asm.get("ptx", "")  # which form of the term ran (Gluon): 2 uses sin.approx
                mode = 2 if "sin.approx" in ptx else 1 if "cos.approx" in ptx else 0
                row.update(n_regs=kern.n_regs, n_spills=kern.n_spills, mode=mode)
                row["us"] = round(1e3 * bench_graph_ms(fn, rep_ms=a.rep_ms), 2)
                if base_out is None:
                    base_out = out.float()
                else:
                    row["rel_diff_vs_R0"] = G.rel(out.float(), base_out)
                row["finite"] = bool(torch.isfinite(out).all())
            except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                traceback.print_exc()
            finally:
                dec.DEFAULT_TUNING = saved
            rows.append(row)
            print(json.dumps(row), flush=True)
        s = None
        torch.cuda.empty_cache()
    base = {(r["ctx"], r["batch"]): r.get("us") for r in rows if r["pairs"] == 0}
    for r in rows:
        b = base.get((r["ctx"], r["batch"]))
        if b and r.get("us"):
            r["slowdown"] = round(r["us"] / b, 3)
    meta = run_meta()
    with open(os.path.join(a.out, "rope_decode_speed.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta))
    print(f"{'shape':>12} {'R':>3} {'mode':>4} {'µs':>8} {'x R=0':>7} {'regs':>5} {'spills':>6}")
    for r in rows:
        shape = f"{r['ctx'] // 1024}k x {r['batch']}"
        print(
            f"{shape:>12} {r['pairs']:>3} {r.get('mode')!s:>4} {r.get('us', float('nan')):>8} "
            f"{r.get('slowdown', ''):>7} {r.get('n_regs', '')!s:>5} {r.get('n_spills', '')!s:>6} "
            f"{r.get('error', '')}"
        )


if __name__ == "__main__":
    main()
