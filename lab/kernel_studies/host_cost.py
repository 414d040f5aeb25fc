"""Host (Python) cost of one OSCAR decode layer's launchers.

Runs what ``oscar_kernels.serving.run_layer`` runs for a decode step (``paged_write`` then
``decode_attention``, backend ``triton``).

* Without a GPU (``TRITON_INTERPRET=1``, CPU tensors) every Triton launch is replaced by a no-op,
  so the time left is the wrappers' own Python (validation, launch rules, argument lists).
* With ``--gpu`` on a CUDA machine the launches are real; at batch 1 × 2k the kernels take a few
  µs each, so the loop is host-bound and its wall time per layer is the host cost, Triton's
  launcher included; ``--gpu`` also times each op alone.

``--path plan`` runs what an engine step runs now (``oscar_kernels.serving``): one
:func:`plan_step` per step, then :func:`run_layer` for ``--layers`` layers (the first layer of the
step validates and plans, the others only launch); µs per layer is the step's time over its layers,
the plan included. ``--fa3`` (GPU, vLLM installed) also times vLLM's FlashAttention-3 decode layer
(``reshape_and_cache_flash`` + ``flash_attn_varlen_func`` on a paged BF16 cache) the same way.

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
    ap.add_argument(
        "--path", choices=("ops", "plan"), default="ops", help="validated ops, or plan + run_layer"
    )
    ap.add_argument("--layers", type=int, default=36, help="layers per step (--path plan)")
    ap.add_argument("--fa3", action="store_true", help="also vLLM's FA3 decode layer (GPU, vLLM installed)")
    ap.add_argument("--json", default="", help="append one JSON line of the results to this file")
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

    if a.path == "plan":
        from oscar_kernels.serving import plan_step, run_layer

        qsl = torch.arange(b + 1, dtype=torch.int32)
        seq_cpu = seq_lens.cpu()

        def new_plan():  # noqa: ANN202 - what an engine's metadata builder makes once per step
            return plan_step(qsl.to(dev), qsl, seq_lens, seq_cpu, table, slots, b, ws, None, num_tokens=b)

        md = new_plan()
        run_layer(md, cache, ep, q, k, v, d**-0.5, "triton")  # the step's first layer: checks + plans

        def layer() -> None:  # noqa: F811 - any further layer of the step: launches only
            run_layer(md, cache, ep, q, k, v, d**-0.5, "triton")

        def first_layer() -> None:  # a new step: its plan and its first layer
            run_layer(new_plan(), cache, ep, q, k, v, d**-0.5, "triton")

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
    print(f"path {a.path}, batch {b} x ctx {n}: {us:.1f} us of {what} per layer")
    res = {"path": a.path, "batch": b, "ctx": n, "gpu": a.gpu, "us_per_layer": round(us, 2)}
    if a.path == "plan":
        first = per_call(first_layer)
        res["us_plan_and_first_layer"] = round(first, 2)
        res[f"us_per_layer_step_of_{a.layers}"] = round((first + (a.layers - 1) * us) / a.layers, 2)
        print(
            f"  a step's plan + its first layer (checks, launch plans): {first:.1f} us; "
            f"{res[f'us_per_layer_step_of_{a.layers}']:.1f} us per layer over a {a.layers}-layer step"
        )
    if a.gpu:
        res["device"] = torch.cuda.get_device_name()
    if a.fa3:
        res["fa3_us_per_layer"] = round(fa3_layer_us(b, n, h, g, d, per_call), 2)
        print(f"  FA3 (vLLM) decode layer: {res['fa3_us_per_layer']:.1f} us of host time per layer")
    if a.json:
        import json

        with open(a.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    if a.gpu and a.path == "ops":
        print(f"  paged_write {per_call(write):.0f} us, decode_attention {per_call(attend):.0f} us")
    else:
        print(f"  {launches[0] / a.iters:.0f} launches per layer")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.iters):
        layer()
    prof.disable()
    pstats.Stats(prof).sort_stats(os.environ.get("OSCAR_SORT", "tottime")).print_stats(
        int(os.environ.get("OSCAR_TOP", "18"))
    )


def fa3_layer_us(b: int, n: int, h: int, g: int, d: int, per_call) -> float:  # noqa: ANN001
    """Host µs of vLLM's FA3 decode layer (cache write + paged attention), 16-token blocks."""
    from vllm import _custom_ops as ops
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    bs = 16
    nb = b * (n // bs + 2)
    kc = torch.zeros(nb, bs, h, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    q = torch.randn(b, h * g, d, device="cuda").bfloat16()
    k = torch.randn(b, h, d, device="cuda").bfloat16()
    v = torch.randn(b, h, d, device="cuda").bfloat16()
    out = torch.empty_like(q)
    table = torch.arange(nb, dtype=torch.int32, device="cuda").view(b, -1)
    seq = torch.full((b,), n, dtype=torch.int32, device="cuda")
    cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
    slots = (table[:, (n - 1) // bs].long() * bs + (n - 1) % bs).long()
    one = torch.ones((), device="cuda")

    def layer() -> None:
        ops.reshape_and_cache_flash(k, v, kc, vc, slots, "auto", one, one)
        flash_attn_varlen_func(
            q, kc, vc, max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=n, seqused_k=seq,
            softmax_scale=d**-0.5, causal=True, block_table=table, out=out, fa_version=3,
        )  # fmt: skip

    return per_call(layer)


if __name__ == "__main__":
    main()
