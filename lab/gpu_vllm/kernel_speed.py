"""Issue #38 on one GPU: where a decode step's merge time goes, and the one-token write before/after.

Qwen3-8B attention shape (32 q heads, 8 KV heads, d = 128, 64-token pages), CUDA-graph replay,
PyTorch SDPA BF16 in the same run. Per decode shape (1 x 2k, 1 x 130k, 8 x 32k):

* ``op_us`` / ``op_nopdl_us``: ``decode_attention`` end to end (query rotation, split kernel,
  merge with the V un-rotation), graph replay, with and without programmatic dependent launch;
* ``kernels_pdl`` / ``kernels_nopdl``: per-kernel device µs of the same graph (torch.profiler).
  With PDL the merge grid starts while the split kernel drains and waits in ``griddepcontrol``:
  its profiled duration includes that wait (what the engine profile called 25 µs a layer);
* ``merge_alone_us``: ``merge_partials`` alone on partials of the op's own shape (graph, no PDL,
  L2 flushed by ``do_bench`` between replays): the merge's own cost, to compare with FA3's combine
  (4 µs a layer);
* merge v1 vs v2 (issue #38; ``DecodeTuning.merge_impl``, v2 the default): every ``op_*`` /
  ``merge_alone_*`` / ``kernels_*`` key without a suffix is v2 (the default), ``*_v1`` the old
  ``merge_splits_kernel``; ``merge_alone_v2_chunk256_us``: v2 with 256-partial steps;
  ``merge_profile_{v1,v2}``: the merge alone's kernels profiled (L2-hot replays, device µs per
  kernel) and ``merge_kernel_us_{v1,v2}`` their sum, the number to hold against FA3's ~4 µs
  combine; ``merge_kernel_us_op_nopdl_{v1,v2}``: the same sum inside the op's graph without PDL;
  ``merge_v2_vs_v1``: the two merges' bf16 outputs on the same partials (max |diff|, fraction
  bitwise equal) and ``op_v2_vs_v1_max_abs`` the op's;
* bytes: the split kernel's INT2 + window bytes and the merge's partial bytes; TB/s and % of
  3.35 TB/s (the H100 SXM's) for the op and for the split kernel's profiled time.

The write: ``plan_write`` / ``run_write`` of 1, 8 and 64 decode tokens (K with error feedback and a
pre-RoPE mean, the default artifact's case), graph replay, the kernels' device µs, and a digest of
the cache written; where the plan runs the feedback loop in row chunks (``feedback_rows``), also
``us_whole_tile``: the same write over the whole token tile; ``ab.sh write`` runs it against an
earlier ``oscar_kernels`` (same digests: bitwise the same caches).

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python3 lab/gpu_vllm/kernel_speed.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from dataclasses import replace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "../../packages/oscar-kernels/benchmarks"))
import gpu_run as G  # noqa: E402
from timing import bench_graph_ms, run_meta  # noqa: E402

import oscar_kernels as ok  # noqa: E402

dec = sys.modules["oscar_kernels.decode_attention"]
H100_BW = 3.35e12
SHAPES = ((2048, 1), (130_000, 1), (32_768, 8))
#: the engine's case: a 2k decode under a block table as wide as the suite's max_model_len (40k),
#: so the split count is planned for 40k (a CUDA graph's grid is fixed) and most splits are empty
WIDE = ((2048, 1, 40_000), (2048, 1, None))


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def us(fn, rep_ms: int = 60) -> float:
    """Graph-replay µs of ``fn`` (on CPU, a smoke run under TRITON_INTERPRET=1: one call, 0.0)."""
    if DEV.type != "cuda":
        fn()
        return 0.0
    return round(1e3 * bench_graph_ms(fn, rep_ms=rep_ms), 2)


def profile_kernels(fn, replays: int = 20) -> dict:
    """Device µs per launch of each kernel in a CUDA graph of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        if t and e.count:
            out[e.key[:60]] = round(t / replays, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


def _is_merge(kernel: str) -> bool:
    """A profiled kernel name of the merge: v1 ``merge_splits_kernel``, v2 ``merge_cols_kernel`` +
    ``unrotate_rows_kernel``."""
    return kernel.startswith(("merge_splits_kernel", "merge_cols_kernel", "unrotate_rows_kernel"))


def sdpa_us(bsz: int, ctx: int) -> float:
    k = torch.randn(bsz, 8, ctx, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qs = torch.randn(bsz, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    return us(lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True))


def decode_shape(ctx: int, bsz: int, width: int | None = None) -> dict:
    s = G._int2_decode_setup(ctx, bsz, width=width)
    args = (s["q"], s["cache"], s["ep"], s["bt"], s["sl"], s["ws"])
    nopdl = replace(dec.DEFAULT_TUNING, use_pdl=False)
    seen = {}
    real_merge = dec.merge_partials

    def spy(po, plse, *a, **kw):  # the op's partials: their shape sizes the merge-alone run
        seen.setdefault("po", tuple(po.shape))
        return real_merge(po, plse, *a, **kw)

    dec.merge_partials = spy
    try:
        ok.decode_attention(*args)
        torch.cuda.synchronize()
    finally:
        dec.merge_partials = real_merge
    b, hq, nt, d = seen["po"]
    r = {"ctx": ctx, "batch": bsz, "table_tokens": width or ctx, "partials": nt}
    r["int2_window_bytes"] = s["nbytes"]
    r["merge_bytes"] = b * hq * nt * (d + 1) * 4 + b * hq * d * 2  # partials + lse read, bf16 out
    v1 = replace(dec.DEFAULT_TUNING, merge_impl="v1")
    nopdl_v1 = replace(nopdl, merge_impl="v1")
    r["merge_impl_default"] = dec.DEFAULT_TUNING.merge_impl
    r["op_us"] = us(lambda: ok.decode_attention(*args))
    # R_V folded into the engine's o_proj (oscar_vllm.fold): the op returns o_rot, merge_cols alone
    folded = (*args[:2], replace(s["ep"], rotated_output=True), *args[3:])
    r["op_folded_us"] = us(lambda: ok.decode_attention(*folded))
    try:
        r["kernels_pdl_folded"] = profile_kernels(lambda: ok.decode_attention(*folded))
    except Exception as e:  # noqa: BLE001 - the timing above stands without the profile
        r["kernels_pdl_folded_error"] = f"{type(e).__name__}: {e}"
    r["op_v1_us"] = us(lambda: ok.decode_attention(*args, tuning=v1))
    r["op_nopdl_us"] = us(lambda: ok.decode_attention(*args, tuning=nopdl))
    r["op_nopdl_v1_us"] = us(lambda: ok.decode_attention(*args, tuning=nopdl_v1))
    r["op_v2_vs_v1_max_abs"] = float(
        (ok.decode_attention(*args).float() - ok.decode_attention(*args, tuning=v1).float()).abs().max()
    )
    po = torch.randn(b, hq, nt, d, device="cuda")
    plse = torch.randn(b, hq, nt, device="cuda") * 4
    g, vrot = s["g"], s["ep"].v_rotation
    c256 = replace(dec.DEFAULT_TUNING, merge_chunk=256)
    merges = {
        "v2": lambda: real_merge(po, plse, g, vrot, torch.bfloat16),
        "v1": lambda: real_merge(po, plse, g, vrot, torch.bfloat16, tuning=v1),
    }
    r["merge_alone_us"] = us(merges["v2"])
    r["merge_alone_v1_us"] = us(merges["v1"])
    r["merge_alone_v2_chunk256_us"] = us(lambda: real_merge(po, plse, g, vrot, torch.bfloat16, tuning=c256))
    a2, a1 = merges["v2"]().float(), merges["v1"]().float()
    diff = {"max_abs": float((a2 - a1).abs().max()), "equal_frac": float((a2 == a1).float().mean())}
    r["merge_v2_vs_v1"] = diff
    for name, fn in merges.items():
        try:
            prof = profile_kernels(fn)
            r[f"merge_profile_{name}"] = prof
            r[f"merge_kernel_us_{name}"] = round(sum(v for k, v in prof.items() if _is_merge(k)), 2)
        except Exception as e:  # noqa: BLE001 - the timings above stand without the profile
            r[f"merge_profile_{name}_error"] = f"{type(e).__name__}: {e}"
    r["sdpa_bf16_us"] = sdpa_us(bsz, ctx)
    r["bf16_bytes"] = bsz * 8 * ctx * 128 * 2 * 2
    for key in ("op_us", "op_nopdl_us"):
        tbs = s["nbytes"] / (r[key] * 1e-6) / 1e12
        r[key.replace("_us", "_tb_s")] = round(tbs, 3)
        r[key.replace("_us", "_pct_3_35")] = round(100 * tbs * 1e12 / H100_BW, 1)
    r["sdpa_tb_s"] = round(r["bf16_bytes"] / (r["sdpa_bf16_us"] * 1e-6) / 1e12, 3)
    r["x_sdpa"] = round(r["sdpa_bf16_us"] / r["op_us"], 2)
    try:
        r["kernels_pdl"] = profile_kernels(lambda: ok.decode_attention(*args))
        r["kernels_nopdl"] = profile_kernels(lambda: ok.decode_attention(*args, tuning=nopdl))
        r["kernels_pdl_v1"] = profile_kernels(lambda: ok.decode_attention(*args, tuning=v1))
        r["kernels_nopdl_v1"] = profile_kernels(lambda: ok.decode_attention(*args, tuning=nopdl_v1))
        for name, key in (("v2", "kernels_nopdl"), ("v1", "kernels_nopdl_v1")):
            merge_us = sum(v for k, v in r[key].items() if _is_merge(k))
            r[f"merge_kernel_us_op_nopdl_{name}"] = round(merge_us, 2)
        split = next((v for k, v in r["kernels_nopdl"].items() if k.startswith("decode_split")), None)
        if split:
            r["split_kernel_tb_s"] = round(s["nbytes"] / (split * 1e-6) / 1e12, 3)
            r["split_kernel_pct_3_35"] = round(100 * s["nbytes"] / (split * 1e-6) / H100_BW, 1)
    except Exception as e:  # noqa: BLE001 - the timings above stand without the profile
        r["profile_error"] = f"{type(e).__name__}: {e}"
    torch.cuda.empty_cache()
    return r


def write_case(n: int) -> dict:
    """One decode write of ``n`` tokens (one per sequence), Qwen3-8B KV shape, K feedback + RoPE,
    through ``plan_write`` / ``run_write`` (launches only: a CUDA graph captures them, so the time is
    device time, not the validated op's host checks), its kernels' device µs (profiler) and a digest
    of the cache it wrote (bitwise comparison across versions: ``ab.sh write`` runs this file with an
    earlier ``oscar_kernels`` first on ``PYTHONPATH``)."""
    import hashlib

    cache, params, plan, args = write_setup(n)
    r = {"tokens": n, "in_bytes": 2 * n * 8 * 128 * 2, "out_bytes": n * 8 * (2 * 128 // 4 + 8 + 2 * 128 * 2)}

    def run() -> None:
        ok.run_write(plan, cache, params, *args)

    run()
    digest = hashlib.sha256()
    for f in ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero", "k_recent", "v_recent"):
        digest.update(getattr(cache, f).view(torch.uint8).cpu().numpy().tobytes())
    r["cache_sha256"] = digest.hexdigest()[:16]
    r["us"] = us(run, rep_ms=40)
    if DEV.type == "cuda":
        r["kernels"] = profile_kernels(run)
    r["feedback_rows"] = getattr(plan, "feedback_rows", None)
    if r["feedback_rows"]:
        # the same write with the feedback loop over the whole token tile (the rule's alternative)
        whole = plan._replace(feedback_rows=0)  # WritePlan is a NamedTuple
        r["us_whole_tile"] = us(lambda: ok.run_write(whole, cache, params, *args), rep_ms=40)
    if DEV.type == "cuda":
        # as in an engine step, where the other layers' weights stream through L2 between two writes
        # of a layer (its F, R and pages come from DRAM): the kernel's device time after a flush
        r["kernels_cold_l2"] = profile_kernels(_after_l2_flush(run))
    # the serving core's default decode write is two passes: the window pass (BF16 sink + ring rows)
    # before the attention, on the critical path, and the INT2 rows beside it
    window = ok.plan_write(cache, params, n, "window", "triton")
    r["us_window"] = us(lambda: ok.run_write(window, cache, params, *args), rep_ms=40)
    if DEV.type == "cuda":
        r["kernels_window_cold_l2"] = profile_kernels(
            _after_l2_flush(lambda: ok.run_write(window, cache, params, *args))
        )
    r["oscar_kernels"] = os.path.dirname(ok.__file__)
    return r


def _after_l2_flush(fn):  # noqa: ANN001, ANN202
    """``fn`` preceded by a write of 256 MB (the H100's L2 is 50 MB, the H200's 60)."""
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)

    def run() -> None:
        flush.zero_()
        fn()

    return run


def records_setup(n: int):  # noqa: ANN201 - (run, rows)
    """One decode step's window-record write for ``n`` sequences (one token each) at vLLM's default
    geometry for the Qwen3-8B shape (8 KV heads, d 128, 64-token window blocks, ring 256, sink 64 in
    four parts of 16, 144 bf16 rows a page, a 131,072-token table): ``(run, rows)``."""
    h, d, wb, ring, sink, part, parts, rpp, width = 8, 128, 64, 256, 64, 16, 4, 144, 2048
    gen = torch.Generator().manual_seed(n)
    groups = -(-2 * h * (wb + part) // rpp)
    pos = 30_000 + 7 * torch.arange(n, dtype=torch.int32)
    tables = torch.zeros(groups, n, width, dtype=torch.int32)
    # distinct pages for the blocks the step writes (no two programs store to one row)
    tables[:, torch.arange(n), pos.long() // wb] = 1 + torch.randperm(groups * n, generator=gen).int().view(
        groups, n
    )
    rows = torch.randn(groups * n + 1, rpp, d, generator=gen).bfloat16()
    ring_k, ring_v = (torch.randn(n, h, ring, d, generator=gen).bfloat16() for _ in range(2))
    sink_k, sink_v = (torch.randn(n, h, sink, d, generator=gen).bfloat16() for _ in range(2))
    idx = torch.arange(n, dtype=torch.int32)
    rows, tables, slots, sidx, pos, ring_k, ring_v, sink_k, sink_v = (
        x.to(DEV) for x in (rows, tables, idx.long() * 64, idx, pos, ring_k, ring_v, sink_k, sink_v)
    )

    def run() -> None:
        ok.write_window_records(
            rows, tables, wb, part, parts, slots, sidx, pos, sidx, ring_k, ring_v, sidx, sink_k, sink_v, True,
            backend="triton",
        )  # fmt: skip

    return run, rows


def records_case(n: int) -> dict:
    """:func:`records_setup`'s write: µs per write, the kernel's device µs with L2 warm and after a
    flush, and a digest of the pages (bitwise comparison across versions: ``ab.sh records``)."""
    import hashlib

    run, rows = records_setup(n)
    run()
    r = {
        "tokens": n,
        "rows_sha256": hashlib.sha256(rows.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:16],
    }
    r["us"] = us(run, rep_ms=40)
    if DEV.type == "cuda":
        r["kernels"] = profile_kernels(run)
        r["kernels_cold_l2"] = profile_kernels(_after_l2_flush(run))
    r["oscar_kernels"] = os.path.dirname(ok.__file__)
    return r


def write_setup(n: int) -> tuple:
    """``write_case``'s write of ``n`` tokens: ``(cache, params, plan, run_write's other arguments)``."""
    from oscar_math.feedback import feedback_matrix

    h, d, dev = 8, 128, DEV
    gen = torch.Generator().manual_seed(n)
    qm, _ = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))
    lam = torch.diag(torch.logspace(0, -3, d, dtype=torch.float64))
    fk = feedback_matrix(qm @ lam @ qm.transpose(-1, -2))
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=gen))[0]
    freq = 1e6 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    rm = torch.zeros(h, d)
    low = torch.arange(d // 2 - 8, d // 2)
    rm[:, low] = 2 * torch.randn(h, 8, generator=gen)
    rm[:, low + d // 2] = 2 * torch.randn(h, 8, generator=gen)
    params = ok.LayerQuantParams(
        rot, rot, k_clip=0.9, v_clip=0.9, k_feedback=fk.float(), k_rope_mean=rm, k_rope_inv_freq=freq.float()
    ).expand(h, d, dev)
    lo = ok.CacheLayout(h, d, page_size=64, sink_tokens=64, recent_tokens=256)
    k = torch.randn(n, h, d, generator=gen).bfloat16().to(dev)
    v = torch.randn(n, h, d, generator=gen).bfloat16().to(dev)
    slots = torch.arange(n, dtype=torch.int64, device=dev) * 64 + 64 + 7
    pos = 30_000 + 7 * torch.arange(n, dtype=torch.int32, device=dev)
    sidx = torch.arange(n, dtype=torch.int32, device=dev)
    cache = ok.allocate_cache(lo, n + 2, n, dev)
    ok.paged_write(cache, params, k, v, slots, pos, sidx, pos + 1, sidx, backend="triton")  # checks once
    plan = ok.plan_write(cache, params, n, "all", "triton")
    return cache, params, plan, (k, v, slots, pos, sidx, pos + 1, sidx)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", choices=("decode", "write", "wide", "records"), default=None)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "kernel_speed.json")
    res = {"meta": run_meta(), "decode": [], "write": [], "records": [], "errors": []}

    def save() -> None:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

    jobs = []
    if a.only in (None, "write"):
        jobs += [("write", n) for n in (1, 8, 64)]
    if a.only in (None, "decode"):
        jobs += [("decode", s) for s in SHAPES]
    if a.only == "wide":
        jobs += [("decode", s) for s in WIDE]
    if a.only in (None, "records"):
        jobs += [("records", n) for n in (1, 8, 144)]
    cases = {"write": write_case, "records": records_case, "decode": lambda x: decode_shape(*x)}
    for kind, x in jobs:
        try:
            r = cases[kind](x)
            res[kind].append(r)
            brief = {k: v for k, v in r.items() if not isinstance(v, dict)}
            print(kind, json.dumps(brief), flush=True)
            for k in (
                "kernels_pdl", "kernels_pdl_folded", "kernels_nopdl", "kernels_pdl_v1", "kernels_nopdl_v1",
                "merge_profile_v2", "merge_profile_v1", "merge_v2_vs_v1",
            ):  # fmt: skip
                if k in r:
                    print("   ", k, json.dumps(r[k]), flush=True)
        except Exception as e:  # noqa: BLE001 - the other cases still run
            res["errors"].append(f"{kind} {x}: {type(e).__name__}: {e}")
            traceback.print_exc()
        save()
    print("errors:", res["errors"])
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
