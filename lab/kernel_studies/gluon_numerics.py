"""Where the Gluon decode kernel's error comes from, on the write-path cache of ``long-128k``.

The check ``long-128k`` of ``gpu_run.py`` (lengths 131072 / 100003, GQA 4, cache written by
``paged_write``) failed with the Gluon kernel (1.1e-2 vs float64, ``tl`` 1.7e-3) while the
same lengths on a random cache passed. This script rebuilds that exact cache (same seed and
construction as ``gpu_run.check_case``) and reports, in the rotated basis (no un-rotation
mixing the quarters), the error of each decode kernel per sequence and per *quarter* of
the head dimension, for several split counts and tile sizes:

* a numerical cause in the value path's algebraic offset (quarter ``j`` of the unpacked
  values is ``512 + c·4^j/2``; the 512 is folded out afterwards) shows up as an error that
  falls 4× per quarter and grows with the tokens per split (fewer splits → worse);
* a tile / page / tail indexing fault would not care about the quarter, nor shrink with
  more splits in this way.

``--emulate`` adds the CPU emulation of the value path (fp32 tensor-core accumulation with
truncation, the behaviour documented for NVIDIA ``mma``) for the same split counts.

Usage (repo root, GPU machine; run once per kernel version to compare, e.g. with the old
package first on ``PYTHONPATH``)::

    OSCAR_GLUON_DECODE=1 PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python packages/oscar-kernels/benchmarks/gluon_numerics.py --tag new --out /tmp/n [--sweep]

``--sweep``: graph-replay times of the decode op at short contexts for a few split-count
targets and tile sizes (the split heuristic's data), with SDPA BF16 in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
# gpu_run and timing stay with the product benchmarks
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../packages/oscar-kernels/benchmarks"))
import gpu_run as G  # noqa: E402
from timing import bench_graph_ms, bench_ms  # noqa: E402

import oscar_kernels as ok  # noqa: E402

dec = sys.modules["oscar_kernels.decode_attention"]


def long_case(gran="kv_head", steps=2):
    """The cache, params and queries of gpu_run's ``long-128k`` (seed 106), as check_case makes them."""
    name, d, hkv, g, page, group, sink, recent, lens, _, _ = G.CASES[6]
    assert name == "long-128k"
    gen = torch.Generator().manual_seed(100 + 6)
    lo = ok.CacheLayout(hkv, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=recent)
    ep = G.make_params(hkv, d, gran, gen).expand(hkv, d, G.DEV)
    cache, _, ep, _, _, bt, ws = G.build(lo, lens, lambda: ep, gen, steps)
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(G.DEV, torch.bfloat16)
    return lo, cache, ep, bt, ws, q, lens, g


def errors(o, want, d):
    """Relative error of the whole row block and of each quarter (normalised by the whole)."""
    nrm = want.norm()
    q4 = d // 4
    diff = o - want
    quarters = [float(diff[..., j * q4 : (j + 1) * q4].norm() / nrm) for j in range(4)]
    return {"all": float(diff.norm() / nrm), "quarters": quarters}


def numerics(tag, log, variants):
    out = []
    for gran, steps in variants:
        lo, cache, ep, bt, ws, q, lens, g = long_case(gran, steps)
        d = lo.head_dim
        scale = 1 / math.sqrt(d)
        q_rot = ok.rotate_queries(q, ep)
        sl = torch.tensor(lens, dtype=torch.int32, device=G.DEV)
        wants = []
        for b, n in enumerate(lens):
            kk, vv = ok.gather_rotated_kv(cache, bt[b], int(ws[b]), n, n, dtype=torch.float64)
            wants.append(G.dense64(q_rot[b : b + 1].double(), kk, vv, scale)[0])
        max_len = bt.shape[1] * lo.page_size
        default_ns = ok.choose_num_splits(len(lens), lo.num_kv_heads, max_len, G.DEV, 64, 16)
        cfgs = [("tl", 128, default_ns)]
        for bn in (64, 32):
            for ns in (default_ns, 33, 9):
                cfgs.append(("gluon", bn, ns))
        for impl, bn, ns in cfgs:
            nw = 4 if impl == "tl" else 1
            try:
                o = dec._launch_decode(
                    q_rot, cache, bt, sl, ws, scale, g, dec.SplitLaunch(ns, bn, nw, 2), impl=impl
                ).double()
            except Exception as e:  # noqa: BLE001 - report and go on
                log(f"{tag} {impl} bn={bn} ns={ns} FAILED {e!r}")
                continue
            if G.DEV.type == "cuda":
                torch.cuda.synchronize()
            row = {"tag": tag, "gran": gran, "steps": steps, "impl": impl, "block_n": bn, "num_splits": ns}
            for b, n in enumerate(lens):
                row[f"seq{b}_len{n}"] = errors(o[b], wants[b], d)
            row["max_all"] = max(v["all"] for k, v in row.items() if k.startswith("seq"))
            log(json.dumps(row))
            out.append(row)
        cache = None
        torch.cuda.empty_cache()
    return out


def emulate(log):
    """The CPU emulation of the value path for the same split counts (written-like data)."""
    sys.path.insert(0, os.path.dirname(__file__))
    from gluon_value_emulation import run  # noqa: PLC0415

    rows = []
    for ns in (132, 33, 9):
        for var in ("split_offset", "tile_offset"):
            e, qe, _ = run(n=131072, ns=ns, variant=var)
            rows.append({"emulated": var, "num_splits": ns, "all": e, "quarters": qe})
            log(json.dumps(rows[-1]))
    return rows


def sweep(log):
    """Graph-replay time of the op at short contexts per (block_n, programs_per_sm), + SDPA."""
    rows = []
    for ctx, bsz in ((8192, 1), (8192, 8), (32768, 1), (32768, 8), (131072, 1), (8192, 32)):
        s = G._int2_decode_setup(ctx, bsz)
        args = (s["q"], s["cache"], s["ep"], s["bt"], s["sl"], s["ws"])
        row = {"ctx": ctx, "batch": bsz}
        row["tl_graph_us"] = 1e3 * bench_graph_ms(lambda a=args: ok.decode_attention(*a, impl="tl"))
        for bn in (32, 64):
            for pps in (4, 8, 16, 32):
                for st in (1, 2):
                    kw = dict(impl="gluon", block_n=bn, programs_per_sm=pps, num_stages=st)
                    key = f"gluon/{bn}/{pps}/{st}"
                    try:
                        row[key] = 1e3 * bench_graph_ms(lambda a=args, kw=kw: ok.decode_attention(*a, **kw))
                    except Exception as e:  # noqa: BLE001
                        row[key] = repr(e)[:80]
        args = s = None
        k = torch.randn(bsz, 8, ctx, 128, device=G.DEV, dtype=torch.bfloat16)
        qkv = (torch.randn(bsz, 32, 1, 128, device=G.DEV, dtype=torch.bfloat16), k, torch.randn_like(k))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        row["sdpa_us"] = 1e3 * bench_ms(lambda t=qkv, f=sdpa: f(*t, enable_gqa=True))
        k = qkv = None
        torch.cuda.empty_cache()
        best = min((x, kk) for kk, x in row.items() if kk.startswith("gluon/") and isinstance(x, float))
        row["best"] = {"cfg": best[1], "us": best[0], "x_sdpa": row["sdpa_us"] / best[0]}
        log(json.dumps(row))
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default="new")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--emulate", action="store_true")
    ap.add_argument("--variants", default="kv_head:2,layer:0")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    os.environ["OSCAR_GLUON_DECODE"] = "1"

    def log(s):
        print(s, flush=True)

    t = time.time()
    res = {"tag": a.tag, "triton": __import__("triton").__version__}
    if a.emulate:
        res["emulation"] = emulate(log)
    if G.DEV.type == "cuda":
        variants = [(v.split(":")[0], int(v.split(":")[1])) for v in a.variants.split(",")]
        res["numerics"] = numerics(a.tag, log, variants)
        if a.sweep:
            res["sweep"] = sweep(log)
    res["seconds"] = round(time.time() - t, 1)
    with open(os.path.join(a.out, f"numerics_{a.tag}.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n== long-128k cache, rotated basis: max over sequences; quarters of the worst sequence ==")
    for r in res.get("numerics", []):
        worst = max((v for k, v in r.items() if k.startswith("seq")), key=lambda v: v["all"])
        qs = " ".join(f"{x:.1e}" for x in worst["quarters"])
        print(f"{a.tag:4s} {r['gran']:8s} steps={r['steps']} {r['impl']:5s} bn={r['block_n']:3d} "
              f"ns={r['num_splits']:3d} err={r['max_all']:.2e} quarters {qs}")  # fmt: skip
    for r in res.get("sweep", []):
        b = r["best"]
        print(f"sweep {r['ctx']}x{r['batch']}: tl {r['tl_graph_us']:.1f} us, sdpa {r['sdpa_us']:.1f} us, "
              f"best gluon {b['cfg']} {b['us']:.1f} us ({b['x_sdpa']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
