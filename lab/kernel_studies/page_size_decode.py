"""Why the decode op is slower in vLLM than in the kernel benchmarks: page size, table width, R.

vLLM hands OSCAR 16-token blocks (its default ``block_size``) and a block table as wide as
``max_model_len`` (131,072 tokens at the Qwen3-8B shape), while the kernel benchmarks use 64-token
pages, a table as wide as the context and no pre-RoPE mean. In the engine (H200, 2026-12-02/03)
the split kernel took 95 µs a layer at 1 x 130k against ~51 µs split + merge in the benchmark.
This study times ``decode_attention`` (graph replay, defaults) for each combination at the
engine's shapes and, per row, the device time of each kernel (torch profiler over graph replays).

Usage (repo root, GPU machine)::

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python3 lab/kernel_studies/page_size_decode.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../packages/oscar-kernels/benchmarks"))
import gpu_run as G  # noqa: E402
from rope_decode_speed import with_pairs  # noqa: E402
from timing import bench_graph_ms, run_meta  # noqa: E402

import oscar_kernels as ok  # noqa: E402

DEV = torch.device("cuda")
#: (tokens per sequence, batch, block-table width in tokens): the engine's two decode shapes with
#: vLLM's table (max_model_len 131072), and 8 x 32k with a table as wide as the context
SHAPES = ((130000, 1, 131072), (32768, 8, 131072), (32768, 8, 32768))
PAGES = (16, 64)
PAIRS = (0, 8)


def kernel_times(fn, reps: int = 20) -> dict:
    """Device µs per replay of each kernel of ``fn``'s graph."""
    from torch.autograd import DeviceType

    gr = torch.cuda.CUDAGraph()
    fn()
    torch.cuda.synchronize()
    with torch.cuda.graph(gr):
        fn()
    gr.replay()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(reps):
            gr.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    return {e.key[:40]: round(e.self_device_time_total / reps, 1) for e in ev}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rep-ms", type=int, default=200)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dec = sys.modules["oscar_kernels.decode_attention"]
    rows = []
    for ctx, bsz, width in SHAPES:
        for page in PAGES:
            s = G._int2_decode_setup(ctx, bsz, page=page, width=width, gran="kv_head")
            gen = torch.Generator().manual_seed(ctx)
            for pairs in PAIRS:
                row = dict(ctx=ctx, batch=bsz, width=width, page=page, pairs=pairs)
                try:
                    ep = with_pairs(s["ep"], 8, 128, pairs, gen)

                    def fn(ep=ep, s=s):
                        return ok.decode_attention(s["q"], s["cache"], ep, s["bt"], s["sl"], s["ws"])

                    fn()
                    torch.cuda.synchronize()
                    kern = dec.LAST_COMPILED["decode_split"]
                    row.update(n_regs=getattr(kern, "n_regs", None), n_spills=getattr(kern, "n_spills", None))
                    lo = s["cache"].layout
                    bn = dec.gluon_block_n(bsz, lo, width, DEV, dec._DEFAULTS["gluon"][2])
                    row["block_n"] = bn
                    row["splits"] = dec.choose_num_splits(bsz, 8, width, DEV, bn, dec._DEFAULTS["gluon"][2])
                    row["us"] = round(1e3 * bench_graph_ms(fn, rep_ms=a.rep_ms), 2)
                    nbytes = bsz * 8 * ctx * 2 * (128 // 4 + 4)
                    row["int2_tb_s"] = round(nbytes / (row["us"] * 1e-6) / 1e12, 2)
                    row["kernels"] = kernel_times(fn)
                except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                    traceback.print_exc()
                rows.append(row)
                print(json.dumps(row), flush=True)
            s = None
            torch.cuda.empty_cache()
    meta = run_meta()
    with open(os.path.join(a.out, "page_size_decode.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(json.dumps(meta))
    head = ("shape", "table", "page", "R", "bn", "splits", "µs", "TB/s")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (14, 6, 4, 2, 3, 6, 8, 5), strict=True)), " kernels")
    for r in rows:
        shape = f"{math.ceil(r['ctx'] / 1024)}k x {r['batch']}"
        ks = " ".join(f"{k.split('_kernel')[0][:14]}={v}" for k, v in r.get("kernels", {}).items())
        print(
            f"{shape:>14} {r['width'] // 1024:>5}k {r['page']:>4} {r['pairs']:>2} "
            f"{r.get('block_n', '')!s:>3} "
            f"{r.get('splits', '')!s:>6} {r.get('us', float('nan')):>8} {r.get('int2_tb_s', '')!s:>5}  {ks}"
            f"{r.get('error', '')}"
        )


if __name__ == "__main__":
    main()
