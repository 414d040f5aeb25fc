"""Host (Python) cost of one OSCAR decode layer's launchers.

Runs what ``oscar_kernels.serving.run_layer`` runs for a decode step (``paged_write`` then
``decode_attention``, backend ``triton``).

* Without a GPU (``TRITON_INTERPRET=1``, CPU tensors) every Triton launch is replaced by a no-op,
  so the time left is the wrappers' own Python (validation, launch rules, argument lists).
* With ``--gpu`` on a CUDA machine the launches are real; at batch 1 × 2k the kernels take a few
  µs each, so the loop is host-bound and its wall time per layer is the host cost, Triton's
  launcher included; ``--gpu`` also times each op alone.

Prints µs per layer and the top functions by own time (cProfile; ``OSCAR_SORT=cumtime`` for the call tree).

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src TRITON_INTERPRET=1 \\
        python lab/kernel_studies/host_cost.py [--batch 1] [--ctx 2048]
    PYTHONPATH=... python lab/kernel_studies/host_cost.py --gpu      # on the H200
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

if "--gpu" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--gpu", action="store_true", help="real launches on CUDA")
    a = ap.parse_args()
    dev = "cuda" if a.gpu else "cpu"
    launches = [0]
    if not a.gpu:
        from triton.runtime import interpreter

        def _no_launch(self, grid):  # noqa: ANN001, ANN202
            def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                launches[0] += 1

            return run

        interpreter.InterpretedFunction.__getitem__ = _no_launch

    from oscar_kernels import CacheLayout, LayerQuantParams, allocate_cache, decode_attention, paged_write

    h, g, d, ps = 8, 4, 128, 16
    lo = CacheLayout(h, d, page_size=ps, sink_tokens=64, recent_tokens=256)
    b, n = a.batch, a.ctx
    pages = b * (n // ps + 2)
    cache = allocate_cache(lo, pages, b, dev)
    eye = torch.eye(d).expand(h, d, d).contiguous()
    ep = LayerQuantParams(k_rotation=eye, v_rotation=eye).expand(h, d, dev)
    q = torch.randn(b, h * g, d, device=dev).bfloat16()
    k = torch.randn(b, h, d, device=dev).bfloat16()
    v = torch.randn(b, h, d, device=dev).bfloat16()
    table = torch.arange(pages, dtype=torch.int32, device=dev).view(b, -1)
    seq_lens = torch.full((b,), n, dtype=torch.int32, device=dev)
    pos = seq_lens.long() - 1
    slots = (table[:, (n - 1) // ps].long() * ps + (n - 1) % ps).long()
    sidx = torch.arange(b, dtype=torch.int32, device=dev)
    ws = torch.arange(b, dtype=torch.int32, device=dev)

    def write() -> None:
        paged_write(cache, ep, k, v, slots, pos, sidx, seq_lens, ws, backend="triton", check_bounds=False)

    def attend() -> None:
        decode_attention(q, cache, ep, table, seq_lens, ws, backend="triton", check_bounds=False)

    def layer() -> None:
        write()
        attend()

    def per_call(fn) -> float:  # noqa: ANN001 - µs per call, the device drained at both ends
        for _ in range(20):
            fn()
        if a.gpu:
            torch.cuda.synchronize()
        launches[0] = 0
        t = time.perf_counter()
        for _ in range(a.iters):
            fn()
        if a.gpu:
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / a.iters * 1e6

    what = "host time (Triton launches included)" if a.gpu else "wrapper Python (launches stubbed)"
    us = per_call(layer)
    print(f"batch {b} x ctx {n}: {us:.0f} us of {what} per layer")
    if a.gpu:
        print(f"  paged_write {per_call(write):.0f} us, decode_attention {per_call(attend):.0f} us")
    else:
        print(f"  {launches[0] / a.iters:.0f} launches per layer")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.iters):
        layer()
    prof.disable()
    pstats.Stats(prof).sort_stats(os.environ.get("OSCAR_SORT", "tottime")).print_stats(18)


if __name__ == "__main__":
    main()
