"""Write-path cost of the INT2 key/value codes: plain rounding against error feedback (format
version 2: a ``d``-step loop per row inside ``paged_write``). Commit d9ee697 of this script also
timed the scale/zero refit of study 5 (measured worse, not kept; docs/results.md).

One ``paged_write`` call (K and V, Triton) of ``N`` prefill tokens of one layer at a model's KV
shape (default Qwen3-8B: 8 KV heads, head dim 128), timed with CUDA events
(``triton.testing.do_bench``, median). Reports ms per call and µs per token per layer; the
plain write of the same run is the baseline. ``--rows k`` (default): feedback on keys only, the
default artifact's case; ``kv``: keys and values. ``--rope``: each variant also with a pre-RoPE
key mean (format version 3: the INT2 key rows centred by ``RoPE_p(m)``, computed in the kernel;
16 low-frequency pairs, Qwen3's ``rope_theta`` 10^6). ``--graph``: also the median of replaying
the call captured in a CUDA graph (shows the write is capturable; no host synchronisation).
``--decode``: the ``N`` tokens are one decode step of ``N`` sequences at positions near 30 000
(each token writes its INT2 row and its BF16 ring row; without it, one prefill chunk whose
tokens all go to INT2 rows only).

::

    python packages/oscar-kernels/benchmarks/write_speed.py --rope --graph --out $OUT/write_speed.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import oscar_kernels as ok  # noqa: E402
from oscar_math.feedback import feedback_matrix  # noqa: E402


def metric(d: int, h: int, gen: torch.Generator) -> torch.Tensor:
    """Dense anisotropic metrics like the key metric after U·P·H (eigenvalues 1 .. 1e-3)."""
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))
    lam = torch.logspace(0, -3, d, dtype=torch.float64)
    return q @ torch.diag(lam) @ q.transpose(-1, -2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--groups", type=int, nargs="+", default=[128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument(
        "--block-t", type=int, nargs="+", default=[128, 32], help="tokens per program (0: the op's default)"
    )
    ap.add_argument(
        "--warps", type=int, nargs="+", default=[0], help="warps per program (0: the op's default)"
    )
    ap.add_argument(
        "--fuse", nargs="+", default=["auto"], choices=["auto", "on", "off"],
        help="K and V in one launch (paged_write's fuse; auto: the op's default)",
    )  # fmt: skip
    ap.add_argument("--rows", default="k", choices=["k", "kv"])
    ap.add_argument("--rope", action="store_true", help="also each variant with a pre-RoPE key mean")
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--graph", action="store_true", help="also time CUDA-graph replay")
    ap.add_argument("--decode", action="store_true", help="one token of each of N sequences")
    ap.add_argument("--only", nargs="+", default=None, help="variant names to time (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        from timing import bench_graph_ms, bench_ms
    else:  # a dry run under TRITON_INTERPRET=1: wall time of one call (no meaning as a speed)
        import time

        def bench_ms(fn, rep_ms: int = 0) -> float:
            t = time.perf_counter()
            fn()
            return 1000 * (time.perf_counter() - t)

    h, d = args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    fk = feedback_matrix(metric(d, h, gen))
    fv = feedback_matrix(metric(d, h, gen))
    q = torch.linalg.qr(torch.randn(h, d, d, generator=gen))[0]
    freq = args.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rmean = torch.zeros(h, d)
    low = torch.arange(d // 2 - 16, d // 2)  # the 16 lowest-frequency pairs, both coordinates
    rmean[:, low] = 2 * torch.randn(h, 16, generator=gen)
    rmean[:, low + d // 2] = 2 * torch.randn(h, 16, generator=gen)
    rope_kw = {"k_rope_mean": rmean, "k_rope_inv_freq": freq.float()}
    rows = []
    report = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "argv": sys.argv}
    for gs in args.groups:
        for n in args.tokens:
            lo = ok.CacheLayout(h, d, page_size=64, group_size=gs, sink_tokens=64, recent_tokens=256)
            pages = -(-n // 64) + 1
            cache = ok.allocate_cache(lo, pages, n + 1 if args.decode else 2, dev)
            k = torch.randn(n, h, d, generator=gen).bfloat16().to(dev)
            v = torch.randn(n, h, d, generator=gen).bfloat16().to(dev)
            slots = torch.arange(n, dtype=torch.int64, device=dev) + 64  # past page 0
            if args.decode:  # token i: the last of sequence i (INT2 row + ring row)
                pos = 30_000 + 7 * torch.arange(n, dtype=torch.int32, device=dev)
                sidx = torch.arange(n, dtype=torch.int32, device=dev)
                lens, ws = pos + 1, sidx.clone()
            else:
                pos = torch.arange(n, dtype=torch.int32, device=dev) + 4096  # INT2 rows, no window rows
                sidx = torch.zeros(n, dtype=torch.int32, device=dev)
                lens = torch.tensor([4096 + n + 512], dtype=torch.int32, device=dev)
                ws = torch.zeros(1, dtype=torch.int32, device=dev)
            variants = {"plain": {}, "feedback": {"k_feedback": fk}}
            if args.rows == "kv":
                variants["feedback"]["v_feedback"] = fv
            if args.rope:
                variants = {
                    **variants,
                    **{f"{name}+rope": {**kw, **rope_kw} for name, kw in variants.items()},
                }
            if args.only:
                variants = {name: kw for name, kw in variants.items() if name in args.only}
            base = None
            configs = [
                (nk, b, w, f)
                for nk in variants.items()
                for b in args.block_t
                for w in args.warps
                for f in args.fuse
            ]
            for (name, kw), bt, nw, fz in configs:
                params = ok.LayerQuantParams(q, q, k_clip=0.9, v_clip=0.9, **kw).expand(h, d, dev)

                call = (cache, params, k, v, slots, pos, sidx, lens, ws)

                fuse = {"auto": None, "on": True, "off": False}[fz]

                def run(call=call, bt=bt, nw=nw, fuse=fuse) -> None:
                    ok.paged_write(
                        *call, backend="triton", block_t=bt or None, num_warps=nw or None, fuse=fuse
                    )

                ms = bench_ms(run, rep_ms=200 if n > 1000 else 50)
                graph_ms = bench_graph_ms(run, rep_ms=50) if (args.graph and dev.type == "cuda") else None
                base = ms if base is None else base
                r = {
                    "mode": "decode" if args.decode else "prefill",
                    "group": gs,
                    "tokens": n,
                    "variant": name,
                    "block_t": bt or "default",
                    "warps": nw or "default",
                    "fuse": fz,
                    "ms": ms,
                    "us_per_token_layer": 1000 * ms / n,
                    "vs_plain": ms / base,
                    "graph_ms": graph_ms,
                }
                rows.append(r)
                print(
                    f"d {d} H {h} group {gs:>3} N {n:>5} block {bt or 'def':>3} warps {nw or 'def':>3} "
                    f"fuse {fz:<4} {name:<16} {ms:9.4f} ms  "
                    f"{r['us_per_token_layer']:8.4f} us/token/layer  x{r['vs_plain']:.2f} plain"
                    + ("" if graph_ms is None else f"  graph {graph_ms:8.4f} ms"),
                    flush=True,
                )
    report["rows"] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
