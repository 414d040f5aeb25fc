"""The dense prefill path's far rows: the torch form against the Triton kernel (``kernels/far_rows.py``).

The H200 profile of one 32k prompt at the Qwen3-8B shape (2026-12-04, 8k-token steps) had ~90 ms a
step of torch gathers, casts and elementwise kernels around FA3 — the far rows (the prefix's INT2
rows dequantised to bf16, with the pre-RoPE mean's term) among them. This times both forms per layer
for the prefix lengths of a 32k prompt's chunks, checks they agree, and reports the bytes moved
(INT2 read + bf16 written) against the H200's 4.8 TB/s.

Usage (repo root, GPU machine)::

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python3 lab/kernel_studies/far_rows_speed.py --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../packages/oscar-kernels/benchmarks"))
import gpu_run as G  # noqa: E402
from timing import bench_ms, run_meta  # noqa: E402

from oscar_kernels.extend_dense import _far_rows, _far_rows_torch  # noqa: E402

HBM_TBS = 4.8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for prefix in (8192, 16384, 24576):
        s = G._int2_decode_setup(prefix, 1, width=131072, gran="kv_head")
        cache, bt, ws, ep = s["cache"], s["bt"], s["ws"], s["ep"]
        h, d = cache.layout.num_kv_heads, cache.layout.head_dim
        gen = torch.Generator().manual_seed(prefix)
        m = torch.zeros(h, d)
        m[:, :8] = torch.randn(h, 8, generator=gen)
        m[:, d // 2 : d // 2 + 8] = torch.randn(h, 8, generator=gen)
        inv = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        ep = dataclasses.replace(ep, k_rope_mean=m.cuda(), k_rope_inv_freq=inv.cuda())
        seq = torch.zeros(prefix, dtype=torch.long, device="cuda")
        pos = torch.arange(prefix, device="cuda")
        args = (cache, ep, bt, ws, seq, pos, torch.bfloat16)
        kt, vt = _far_rows_torch(*args)
        kk, vv = _far_rows(*args)
        diff = max(float((kk.float() - kt.float()).abs().max()), float((vv.float() - vt.float()).abs().max()))
        t_torch = bench_ms(lambda args=args: _far_rows_torch(*args))
        t_tri = bench_ms(lambda args=args: _far_rows(*args))
        nbytes = prefix * h * 2 * (d // 4 + 4 + 2 * d)  # codes + scale/zero read, bf16 written, K and V
        r = dict(prefix=prefix, torch_ms=t_torch, triton_ms=t_tri, speedup=t_torch / t_tri,
                 tbs=nbytes / t_tri / 1e9, max_abs_diff=diff, v_equal=bool(torch.equal(vv, vt)))  # fmt: skip
        rows.append(r)
        print(
            f"far rows {prefix:>6} x {h} heads x {d}: torch {t_torch:7.3f} ms, triton {t_tri:7.3f} ms "
            f"= {r['speedup']:5.1f}x, {r['tbs']:.2f} TB/s of {HBM_TBS} ({100 * r['tbs'] / HBM_TBS:.0f}%); "
            f"max |diff| {diff:.2g}, V bitwise {r['v_equal']}",
            flush=True,
        )
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "far_rows_speed.json"), "w") as f:
            json.dump({"meta": run_meta(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
