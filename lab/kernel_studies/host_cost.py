"""Host (Python) cost of one OSCAR decode layer's launchers, without a GPU.

Runs what ``oscar_vllm.step.run_layer`` runs for a decode step (``paged_write`` then
``decode_attention``, backend ``triton``) on CPU tensors under ``TRITON_INTERPRET=1`` with every
Triton launch replaced by a no-op, so the time left is the wrappers' own Python (validation,
launch rules, argument lists). Triton's own launcher cost on a GPU (~10-40 µs per launch, not
measured here) comes on top. Prints µs per layer and the top functions by own time.

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src TRITON_INTERPRET=1 \\
        python lab/kernel_studies/host_cost.py [--batch 1] [--ctx 2048]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=300)
    a = ap.parse_args()

    from triton.runtime import interpreter

    launches = [0]

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
    cache = allocate_cache(lo, pages, b)
    ep = LayerQuantParams(
        k_rotation=torch.eye(d).expand(h, d, d).contiguous(), v_rotation=torch.eye(d).expand(h, d, d).contiguous()
    ).expand(h, d, "cpu")
    q = torch.randn(b, h * g, d).bfloat16()
    k = torch.randn(b, h, d).bfloat16()
    v = torch.randn(b, h, d).bfloat16()
    table = torch.arange(pages, dtype=torch.int32).view(b, -1)
    seq_lens = torch.full((b,), n, dtype=torch.int32)
    pos = seq_lens.long() - 1
    slots = (table[:, (n - 1) // ps].long() * ps + (n - 1) % ps).long()
    sidx = torch.arange(b, dtype=torch.int32)
    ws = torch.arange(b, dtype=torch.int32)

    def layer() -> None:
        paged_write(cache, ep, k, v, slots, pos, sidx, seq_lens, ws, backend="triton", check_bounds=False)
        decode_attention(q, cache, ep, table, seq_lens, ws, backend="triton", check_bounds=False)

    for _ in range(20):
        layer()
    launches[0] = 0
    t = time.perf_counter()
    for _ in range(a.iters):
        layer()
    us = (time.perf_counter() - t) / a.iters * 1e6
    print(f"batch {b} x ctx {n}: {us:.0f} us of wrapper Python per layer, {launches[0] / a.iters:.0f} launches")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.iters):
        layer()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
