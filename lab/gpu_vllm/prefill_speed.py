"""Issue #38 on one GPU, op level: the dense prefill's glue and the prefix hits' window restore,
each with the launches of 2026-12-06 against the torch forms they replaced, in one run.

* ``prefill``: ``extend_attention`` of one chunk of ``T`` tokens over a cached prefix of ``P``
  (Qwen3-8B attention: 32 query / 8 KV heads, d = 128, 64-token pages, sink 64 + recent 256,
  per-head rotations and a key mean), the dense path with torch's FlashAttention-2 (what both
  engines fall back to), timed with CUDA events (``triton.testing.do_bench``, median ms):
  ``new`` (near-rows kernel, fused merge + un-rotation) vs ``torch_glue`` (``_near_rows_torch``,
  ``merge_two_ref`` + ``unrotate_output``), outputs compared; ``write_records`` times the window
  records of the same chunk (``write_window_records``, block 64, sink part 16) at its size.
* ``restore``: one layer's window restore of ``R`` prefix hits at 100k tokens (the shared
  workload's 48), host wall per layer with a synchronisation: ``restore_windows`` per row vs
  ``restore_window_rows`` (index built in the first layer, reused by the next: both timed).

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python3 lab/gpu_vllm/prefill_speed.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../packages/oscar-kernels/tests"))
from conftest import fill_cache, make_params  # noqa: E402

import oscar_kernels as ok  # noqa: E402
from oscar_kernels import extend_dense as xd  # noqa: E402
from oscar_kernels import rotate as rot  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
H, G, D = 8, 4, 128


def bench_ms(fn) -> float:  # noqa: ANN001
    if DEV.type != "cuda":
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=3, rep=200))


def prefill_case(t: int, p: int, seed: int, dense) -> dict:  # noqa: ANN001
    gen = torch.Generator().manual_seed(seed)
    lo = ok.CacheLayout(H, D, page_size=64, sink_tokens=64, recent_tokens=256)
    cache, params, bt, ws, keys, values = fill_cache(lo, [p + t], gen, "kv_head", backend="auto", pending=[t])
    ep = params.expand(H, D, cache.device)
    cu = torch.tensor([0, t], dtype=torch.int32, device=DEV)
    pre = torch.tensor([p], dtype=torch.int32, device=DEV)
    q = torch.randn(t, H * G, D, generator=gen).bfloat16().to(DEV)
    k, v = keys[0][p:].to(DEV), values[0][p:].to(DEV)

    def call():  # noqa: ANN202
        return ok.extend_attention(
            q, k, v, cache, ep, cu, pre, bt, ws, t, backend="auto", dense=dense,
            host_lens=([t], [p + t]), dense_min_query=2,
        )  # fmt: skip

    res: dict = {"tokens": t, "prefix": p}
    out_new = call()
    res["new_ms"] = round(bench_ms(call), 3)
    saved = (xd._near_rows, xd.merge_unrotate)
    xd._near_rows = xd._near_rows_torch
    xd.merge_unrotate = lambda o1, l1, o2, l2, e, dt: rot.merge_unrotate(
        o1, l1, o2, l2, e, dt, backend="torch"
    )
    try:
        out_old = call()
        res["torch_glue_ms"] = round(bench_ms(call), 3)
    finally:
        xd._near_rows, xd.merge_unrotate = saved
    diff = (out_new.float() - out_old.float()).abs()
    res["max_abs_diff"] = float(diff.max())
    res["frac_equal"] = float((out_new == out_old).float().mean())
    res["speedup"] = round(res["torch_glue_ms"] / res["new_ms"], 3)
    return res


def records_case(t: int, seed: int) -> dict:
    from oscar_kernels.serving import WindowPages, plan_window_records, write_window_pages
    from oscar_kernels.serving.plan import plan_step

    gen = torch.Generator().manual_seed(seed)
    lo = ok.CacheLayout(H, D, page_size=64, sink_tokens=64, recent_tokens=256)
    cache = ok.allocate_cache(lo, t // 64 + 4, 2, DEV)
    rpp = ok.page_bytes(lo) // (2 * D)
    plan = plan_window_records(H, 64, 64, 256, rpp, in_flight_tokens=1)
    blocks = t // plan.block_size + 2
    pages = WindowPages(
        torch.zeros(plan.groups * blocks + 1, rpp, D, dtype=torch.bfloat16, device=DEV), H, plan, 64
    )
    tables = (1 + torch.arange(plan.groups * blocks, device=DEV)).reshape(plan.groups, 1, blocks).int()
    qsl = torch.tensor([0, t], dtype=torch.int32)
    seq = torch.tensor([t], dtype=torch.int32)
    table = torch.arange(t // 64 + 1, dtype=torch.int32)[None]
    md = plan_step(qsl.to(DEV), qsl, seq.to(DEV), seq, table.to(DEV), torch.arange(t, device=DEV), 1,
                   torch.tensor([0], device=DEV), None)  # fmt: skip
    params = make_params(H, D, "kv_head", gen).expand(H, D, DEV)
    k = torch.randn(t, H, D, generator=gen).bfloat16().to(DEV)
    v = torch.randn(t, H, D, generator=gen).bfloat16().to(DEV)
    ms = bench_ms(lambda: write_window_pages(cache, params, k, v, md, pages, tables))
    return {"tokens": t, "write_window_pages_ms": round(ms, 3), "plan": str(plan)}


def restore_case(rows: int, n_cached: int, seed: int) -> dict:
    from oscar_kernels.serving import WindowPages, plan_window_records, restore_window_rows, restore_windows

    gen = torch.Generator().manual_seed(seed)
    lo = ok.CacheLayout(H, D, page_size=64, sink_tokens=64, recent_tokens=256)
    cache = ok.allocate_cache(lo, 4, rows, DEV)
    rpp = ok.page_bytes(lo) // (2 * D)
    plan = plan_window_records(H, 64, 64, 256, rpp, in_flight_tokens=1)
    width = n_cached // plan.block_size + 2
    pages = WindowPages(torch.randn(2000, rpp, D, generator=gen).bfloat16().to(DEV), H, plan, 64)
    tables = torch.randint(0, 2000, (plan.groups, rows, width), generator=gen).int().to(DEV)
    restore = [(r, r, n_cached + r) for r in range(rows)]

    def per_row() -> None:
        for row, slot, n in restore:
            restore_windows(cache, slot, pages, tables[:, row], n)

    def timed(fn) -> float:  # noqa: ANN001 - host wall of one call, device work included
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if DEV.type == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t)

    per_row()  # first calls pay allocator and kernel set-up
    per_row_ms = min(timed(per_row) for _ in range(3))
    memo: dict = {}
    first_ms = timed(lambda: restore_window_rows(cache, pages, tables, restore, memo))
    next_ms = min(timed(lambda: restore_window_rows(cache, pages, tables, restore, memo)) for _ in range(3))
    return {
        "rows": rows, "n_cached": n_cached, "per_row_ms_per_layer": round(per_row_ms, 3),
        "batched_first_layer_ms": round(first_ms, 3), "batched_next_layers_ms": round(next_ms, 3),
        "per_step_36_layers_ms_per_row": round(36 * per_row_ms, 1),
        "per_step_36_layers_ms_batched": round(first_ms + 35 * next_ms, 1),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/prefill-speed")
    ap.add_argument("--small", action="store_true", help="CPU smoke sizes")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dense = ok.torch_flash_attention() if DEV.type == "cuda" else ok.dense_attention_ref
    res: dict = {
        "device": torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    cases = [(64, 320, 1)] if a.small else [(8192, 0, 1), (8192, 16384, 2), (16384, 16384, 3)]
    jobs = [(f"prefill_{t}_at_{p}", lambda t=t, p=p, s=s: prefill_case(t, p, s, dense)) for t, p, s in cases]
    jobs.append(("records", lambda: records_case(64 if a.small else 16384, 5)))
    jobs.append(("restore", lambda: restore_case(3 if a.small else 48, 1000 if a.small else 100_000, 7)))
    for name, job in jobs:
        try:
            res[name] = job()
        except Exception as e:  # keep the other cases
            res[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}
        print(name, json.dumps(res[name])[:400], flush=True)
        with open(os.path.join(a.out, "prefill_speed.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
