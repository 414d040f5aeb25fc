"""H200 correctness checks + benchmarks of the OSCAR paged INT2 kernels, in one run.

Usage (repo root, on the GPU machine)::

    bash packages/oscar-kernels/benchmarks/gpu_run.sh [--quick] [--skip-check] [--skip-bench] [--tune]
    bash packages/oscar-kernels/benchmarks/gpu_run.sh --gluon --tune --decode-only  # Gluon kernel on

Writes ``check.json``, ``bench.json`` and a log under ``--out``; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(__file__))
import importlib  # noqa: E402

from timing import bench_graph_ms, bench_ms, copy_bandwidth_gbs  # noqa: E402

import oscar_kernels as ok  # noqa: E402

dec_mod = importlib.import_module("oscar_kernels.decode_attention")
ext_mod = importlib.import_module("oscar_kernels.extend_attention")
wr_mod = importlib.import_module("oscar_kernels.paged_write")
from oscar_math import dequantize_int2, quantize_int2, unpack_int2  # noqa: E402

OUT_DIR = "."
DEV = torch.device(os.environ.get("OSCAR_DEVICE", "cuda"))  # "cpu" + TRITON_INTERPRET=1 for a dry run


def _poison(*shape, dtype, device):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def rand_orth(*shape, gen):
    a = torch.randn(*shape, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()


def make_params(hkv, d, gran, gen):
    shape = (d, d) if gran == "layer" else (hkv, d, d)
    mean = torch.randn(hkv, d, generator=gen) * 0.5
    kc = 0.8 + 0.2 * torch.rand(hkv, generator=gen)
    return ok.LayerQuantParams(rand_orth(*shape, gen=gen), rand_orth(*shape, gen=gen), mean, kc, 0.9)


def rand_kv(n, hkv, d, gen):
    # heavy-ish tails + a per-channel offset, like real keys
    x = torch.randn(n, hkv, d, generator=gen) * (1 + 2 * torch.rand(d, generator=gen))
    x = x + torch.randn(d, generator=gen)
    return x.to(DEV, torch.bfloat16)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- checks
def build(lo, lens, params_fn, gen, steps, precise=False):
    """Write all tokens of ``lens`` into a fresh cache with the Triton write (prefill of
    L - steps tokens then ``steps`` single-token decode writes) and, in parallel, with
    the torch reference. Returns everything the checks need."""
    bsz = len(lens)
    pages_per = [max(1, math.ceil(n / lo.page_size)) for n in lens]
    maxp = max(pages_per) + 1
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=gen)
    bt = torch.zeros(bsz, maxp, dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages_per):
        bt[b, :n] = perm[i : i + n].int()
        i += n
    ws = torch.randperm(bsz + 2, generator=gen)[:bsz].int()
    cache = ok.allocate_cache(lo, num_pages, bsz + 2, DEV)
    # garbage, not zeros, in unwritten memory
    for t in (cache.k_codes, cache.v_codes):
        t.random_(0, 256)
    for t in (
        cache.k_scale,
        cache.k_zero,
        cache.v_scale,
        cache.v_zero,
        cache.k_sink,
        cache.v_sink,
        cache.k_recent,
        cache.v_recent,
    ):
        t.normal_()
    ref = ok.PagedKVCache(lo, *[getattr(cache, f).clone() for f in ok.PagedKVCache.TENSOR_FIELDS])
    ep = params_fn()
    ks = [rand_kv(n, lo.num_kv_heads, lo.head_dim, gen) for n in lens]
    vs = [rand_kv(n, lo.num_kv_heads, lo.head_dim, gen) for n in lens]
    bt_d, ws_d = bt.to(DEV), ws.to(DEV)

    def write(first, last):  # positions [first[b], last[b]) of every sequence
        slots, pos, sidx, kk, vv = [], [], [], [], []
        for b in range(bsz):
            p = torch.arange(first[b], last[b])
            if len(p) == 0:
                continue
            slots.append(bt[b, (p // lo.page_size)].long() * lo.page_size + p % lo.page_size)
            pos.append(p)
            sidx.append(torch.full_like(p, b))
            kk.append(ks[b][first[b] : last[b]])
            vv.append(vs[b][first[b] : last[b]])
        if not slots:
            return
        sl = torch.cat(slots).to(DEV)
        args = (torch.cat(kk), torch.cat(vv), sl, torch.cat(pos).to(DEV).int(), torch.cat(sidx).to(DEV).int())
        lens_now = torch.tensor(last, dtype=torch.int32, device=DEV)
        ok.paged_write(cache, ep, *args, lens_now, ws_d, backend="triton", precise=precise)
        ok.paged_write(ref, ep, *args, lens_now, ws_d, backend="torch")

    pre = [max(0, n - steps) for n in lens]
    write([0] * bsz, pre)
    for s in range(steps):
        cur = [min(n, p + s) for n, p in zip(lens, pre, strict=True)]
        write(cur, [min(n, c + 1) for n, c in zip(lens, cur, strict=True)])
    return cache, ref, ep, ks, vs, bt_d, ws_d


def code_mismatch(cache, ref, lens, bt, lo):
    out = {}
    for name in ("k", "v"):
        diff = big = tot = 0
        sdiff = stot = 0
        for b, n in enumerate(lens):
            if n == 0:
                continue
            p = torch.arange(n, device=DEV)
            pg = bt[b].long()[p // lo.page_size]
            off = p % lo.page_size
            a = unpack_int2(getattr(cache, f"{name}_codes")[pg, :, off]).int()
            r = unpack_int2(getattr(ref, f"{name}_codes")[pg, :, off]).int()
            diff += int((a != r).sum())
            big += int(((a - r).abs() > 1).sum())
            tot += a.numel()
            sa = getattr(cache, f"{name}_scale")[pg, :, off]
            sr = getattr(ref, f"{name}_scale")[pg, :, off]
            sdiff += int((sa != sr).sum())
            stot += sa.numel()
        out[f"{name}_code_mismatch"] = diff / max(tot, 1)
        out[f"{name}_code_off_by_more_than_1"] = big
        out[f"{name}_scale_mismatch"] = sdiff / max(stot, 1)
    return out


def dense64(q, k, v, scale, mask=None):
    """q [M, Hq, d], k/v [N, H, d] float64 → [M, Hq, d]."""
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, 1)
    vv = v.repeat_interleave(g, 1)
    s = torch.einsum("mhd,nhd->hmn", q, kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, -1), vv)


def unrot64(o, ep):
    h = ep.v_rotation.shape[0]
    m, hq, d = o.shape
    return (o.reshape(m, h, hq // h, d) @ ep.v_rotation.double().transpose(-1, -2)).reshape(o.shape)


def raw_effective(k, v, ep, lo, n_win_end):
    """Keys/values a perfect implementation would attend to, from raw k/v (f64)."""
    n = k.shape[0]
    kr = torch.einsum("nhd,hde->nhe", k.float() - ep.k_mean, ep.k_rotation)
    vr = torch.einsum("nhd,hde->nhe", v.float(), ep.v_rotation)
    kq = dequantize_int2(quantize_int2(kr, lo.group, ep.k_clip[:, None])).double()
    vq = dequantize_int2(quantize_int2(vr, lo.group, ep.v_clip[:, None])).double()
    j = torch.arange(n, device=DEV)
    win = (j < lo.sink_tokens) | (j >= max(lo.sink_tokens, n_win_end - lo.recent_tokens))
    kq[win] = kr[win].bfloat16().double()
    vq[win] = vr[win].bfloat16().double()
    return kq, vq, kr.double(), vr.double()


def check_case(name, d, hkv, g, page, group, sink, recent, lens, gran, steps, seed, log, precise=False):
    gen = torch.Generator().manual_seed(seed)
    lo = ok.CacheLayout(hkv, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=recent)
    params = make_params(hkv, d, gran, gen)
    ep = params.expand(hkv, d, DEV)
    cache, ref, ep, ks, vs, bt, ws = build(lo, lens, lambda: ep, gen, steps, precise)
    if DEV.type == "cuda":
        torch.cuda.synchronize()
    res = {
        "case": name,
        "d": d,
        "H_kv": hkv,
        "gqa": g,
        "page": page,
        "group": lo.group,
        "sink": sink,
        "recent": recent,
        "lens": lens,
        "granularity": gran,
    }
    res.update(code_mismatch(cache, ref, lens, bt, lo))
    win_max = 0.0
    for f in ("k_sink", "v_sink", "k_recent", "v_recent"):
        a, r = getattr(cache, f), getattr(ref, f)
        win_max = max(win_max, float((a.float() - r.float()).abs().max()) if a.numel() else 0.0)
    res["window_max_abs_diff_vs_ref"] = win_max
    scale = 1.0 / math.sqrt(d)
    bsz = len(lens)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(bsz, hkv * g, d, generator=gen).to(DEV, torch.bfloat16)
    dec_mod._empty = _poison
    o = ok.decode_attention(q, cache, ep, bt, sl, ws, backend="triton").double()
    dec_mod._empty = torch.empty
    res["decode_finite"] = bool(torch.isfinite(o).all())
    res["decode_impl"] = dec_mod.resolve_launch(cache, q)[0]
    qr = ok.rotate_queries(q, ep).double()
    e_tight = e_raw = e_quant = 0.0
    for b, n in enumerate(lens):
        if n == 0:
            e_tight = max(e_tight, float(o[b].abs().max()))
            continue
        kk, vv = ok.gather_rotated_kv(cache, bt[b], int(ws[b]), n, n, dtype=torch.float64)
        want = unrot64(dense64(qr[b : b + 1], kk, vv, scale), ep)[0]
        e_tight = max(e_tight, rel(o[b], want))
        kq, vq, kx, vx = raw_effective(ks[b], vs[b], ep, lo, n)
        e_raw = max(e_raw, rel(o[b], unrot64(dense64(qr[b : b + 1], kq, vq, scale), ep)[0]))
        e_quant = max(e_quant, rel(o[b], unrot64(dense64(qr[b : b + 1], kx, vx, scale), ep)[0]))
    res.update(
        decode_rel_err_vs_f64_cache=e_tight,
        decode_rel_err_vs_f64_raw=e_raw,
        decode_rel_err_vs_unquantised=e_quant,
    )
    # extend: the last c tokens of each sequence as a chunk over its prefix
    chunk = [min(n, c) for n, c in zip(lens, [37, 300, 1, 129, 64, 5, 77, 250, 16][: len(lens)], strict=True)]
    cu = torch.tensor([0] + list(torch.tensor(chunk).cumsum(0)), dtype=torch.int32, device=DEV)
    prefix = torch.tensor([n - c for n, c in zip(lens, chunk, strict=True)], dtype=torch.int32, device=DEV)
    qe = torch.randn(int(cu[-1]), hkv * g, d, generator=gen).to(DEV, torch.bfloat16)
    ke = torch.cat([ks[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunk, strict=True))])
    ve = torch.cat([vs[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunk, strict=True))])
    # the cache holds the chunks' ring rows (build wrote everything); an engine writes them
    # after extend: put the prefix's ring rows back, as the cache is before the chunk's ring write
    for b, (n, c) in enumerate(zip(lens, chunk, strict=True)):
        p = n - c
        r0 = max(lo.sink_tokens, p - lo.recent_tokens)
        if c == 0 or r0 >= p or lo.recent_tokens == 0:
            continue
        pos = torch.arange(r0, p)
        slots = (bt[b].cpu().long()[pos // lo.page_size] * lo.page_size + pos % lo.page_size).to(DEV)
        args = (ks[b][r0:p], vs[b][r0:p], slots, pos.to(DEV).int(), torch.zeros_like(pos).to(DEV).int())
        sl1 = torch.tensor([p], dtype=torch.int32, device=DEV)
        ok.paged_write(cache, ep, *args, sl1, ws[b : b + 1], backend="triton", precise=precise, parts="ring")
    ext_mod._empty = _poison
    oe = ok.extend_attention(qe, ke, ve, cache, ep, cu, prefix, bt, ws, max(chunk), backend="triton").double()
    ext_mod._empty = torch.empty
    res["extend_finite"] = bool(torch.isfinite(oe).all()) if oe.numel() else True
    qer = ok.rotate_queries(qe, ep).double()
    ker, ver = ok.rotate_chunk(ke, ve, ep)
    e_ext = 0.0
    for b, (n, c) in enumerate(zip(lens, chunk, strict=True)):
        if c == 0:
            continue
        p = n - c
        s0 = int(cu[b])
        # per query token t: key j is the INT2 row iff sink <= j <= t - recent, else BF16 (sink
        # row, ring row of a prefix key, the chunk's rotated key); both copies, one mask
        kq, vq = ok.gather_rotated_kv(cache, bt[b], int(ws[b]), n, n + lo.recent_tokens, dtype=torch.float64)
        kb, vb = kq.clone(), vq.clone()
        hk, hv = ok.gather_rotated_kv(cache, bt[b], int(ws[b]), p, p + 1, dtype=torch.float64)
        kb[:p], vb[:p] = hk, hv
        c0 = max(p, lo.sink_tokens)
        if lo.recent_tokens > 0 and c0 < n:
            kb[c0:n], vb[c0:n] = ker[s0 + c0 - p : s0 + c].double(), ver[s0 + c0 - p : s0 + c].double()
        t = p + torch.arange(c, device=DEV)[:, None]
        j = torch.arange(n, device=DEV)[None, :]
        quant = ((j >= lo.sink_tokens) & (j <= t - lo.recent_tokens))[None]
        g = qer.shape[1] // kq.shape[1]
        sc = (
            torch.where(
                quant,
                torch.einsum("mhd,nhd->hmn", qer[s0 : s0 + c], kq.repeat_interleave(g, 1)),
                torch.einsum("mhd,nhd->hmn", qer[s0 : s0 + c], kb.repeat_interleave(g, 1)),
            )
            * scale
        )
        pr = torch.softmax(sc.masked_fill(~(j <= t)[None], float("-inf")), -1)
        o64 = torch.einsum("hmn,nhd->mhd", pr * ~quant, vb.repeat_interleave(g, 1)) + torch.einsum(
            "hmn,nhd->mhd", pr * quant, vq.repeat_interleave(g, 1)
        )
        e_ext = max(e_ext, rel(oe[s0 : s0 + c], unrot64(o64, ep)))
    res["extend_rel_err_vs_f64_cache"] = e_ext
    res["pass"] = bool(
        res["decode_finite"]
        and res["extend_finite"]
        and e_tight < 1e-2
        and e_ext < 1e-2
        and res["k_code_mismatch"] <= 5e-3
        and res["v_code_mismatch"] <= 5e-3
        and res["k_code_off_by_more_than_1"] == 0
        and res["v_code_off_by_more_than_1"] == 0
    )
    log(json.dumps(res))
    return res


CASES = [
    # name, d, H_kv, gqa, page, group, sink, recent, lens, granularity, decode steps
    ("mixed-128", 128, 8, 4, 64, None, 64, 256, [1, 63, 64, 65, 319, 320, 321, 1000, 4097], "layer", 3),
    ("d64-kvhead", 64, 3, 3, 16, None, 64, 256, [5, 300, 777], "kv_head", 2),
    ("g32-gqa1", 128, 4, 1, 32, 32, 64, 256, [321, 2000, 64], "layer", 1),
    ("zero-len-gqa8", 64, 2, 8, 64, 32, 16, 48, [0, 17, 65, 500], "kv_head", 1),
    ("page16-steps", 128, 8, 4, 16, None, 64, 256, [9000, 33, 336], "layer", 7),
    ("d128-gqa8-g64", 128, 2, 8, 64, 64, 64, 256, [2049, 321], "kv_head", 2),
    ("long-128k", 128, 8, 4, 64, None, 64, 256, [131072, 100003], "kv_head", 2),
]


def run_checks(log, quick, only=None):
    results = []
    for i, c in enumerate(CASES):
        if (quick and c[0] == "long-128k") or (only and c[0] not in only):
            continue
        t = time.time()
        try:
            r = check_case(*c, seed=100 + i, log=log)
        except Exception as e:  # keep going: one broken case must not cost the whole device call
            log(f"CASE {c[0]} FAILED: {traceback.format_exc()}")
            r = {"case": c[0], "pass": False, "error": repr(e)}
        r["seconds"] = round(time.time() - t, 1)
        results.append(r)
    if only and "mixed-128-ieee" in only:  # the write's precise mode: not decode, run on request
        # full-fp32 rotation in the write: code mismatch vs the reference should drop to ~0
        r = check_case(*CASES[0][:1], *CASES[0][1:], seed=100, log=log, precise=True)
        r["case"] = "mixed-128-ieee"
        results.append(r | {"seconds": 0})
    return results


# ----------------------------------------------------------------------------- benchmarks
def bench_decode(ctx, bsz, copy_gbs, log, tune=None):
    hkv, g, d, page = 8, 4, 128, 64
    lo = ok.CacheLayout(hkv, d, page_size=page)
    pages_per = ctx // page
    num_pages = bsz * pages_per
    gen = torch.Generator().manual_seed(ctx + bsz)
    cache = ok.allocate_cache(lo, num_pages, bsz, DEV)
    fill_random(cache)
    bt = torch.randperm(num_pages, device=DEV).int().reshape(bsz, pages_per)
    sl = torch.full((bsz,), ctx, dtype=torch.int32, device=DEV)
    ws = torch.arange(bsz, dtype=torch.int32, device=DEV)
    ep = make_params(hkv, d, "layer", gen).expand(hkv, d, DEV)
    q = torch.randn(bsz, hkv * g, d, device=DEV, dtype=torch.bfloat16)
    n_int2 = ctx - lo.window_tokens
    bytes_int2 = bsz * hkv * n_int2 * 2 * (d // 4 + 4)
    bytes_win = bsz * hkv * lo.window_tokens * d * 2 * 2
    bytes_bf16 = bsz * hkv * ctx * d * 2 * 2
    row = {"ctx": ctx, "batch": bsz, "bytes_int2_path": bytes_int2 + bytes_win, "bytes_bf16": bytes_bf16}
    cfgs = tune or [{}]
    best = None
    if tune:  # by graph-replay time: eager calls are host-bound (600-1400 µs for 15-1100 µs of GPU work)
        row["tune_graph_us"] = {}
        for cfg in cfgs:
            gms = bench_graph_ms(
                lambda cfg=cfg: ok.decode_attention(q, cache, ep, bt, sl, ws, backend="triton", **cfg)
            )
            row["tune_graph_us"][json.dumps(cfg)] = gms * 1e3
            log(f"  decode int2 ctx={ctx} B={bsz} {cfg}: graph {gms * 1e3:.1f} us")
            if best is None or gms < best[0]:
                best = (gms, cfg)
    cfg = best[1] if best else {}
    ms = bench_ms(lambda: ok.decode_attention(q, cache, ep, bt, sl, ws, backend="triton", **cfg))
    log(f"  decode int2 ctx={ctx} B={bsz} {cfg}: eager {ms * 1e3:.1f} us")
    impl, bn, nw, pps = dec_mod.resolve_launch(cache, q, cfg.get("impl", "auto"), cfg.get("block_n"),
                                               cfg.get("num_warps"), cfg.get("programs_per_sm"))  # fmt: skip
    if impl == "gluon" and cfg.get("block_n") is None:  # the op's own tile-size rule
        bn = dec_mod.gluon_block_n(bsz, lo, ctx, DEV, pps)
    row["int2_cfg"] = dict(impl=impl, block_n=bn, num_warps=nw, programs_per_sm=pps)
    row["int2_ms"] = ms
    row["int2_graph_ms"] = bench_graph_ms(
        lambda: ok.decode_attention(q, cache, ep, bt, sl, ws, backend="triton", **cfg)
    )
    if impl != "tl":  # the portable kernel, same run (the "before" kernel)
        row["tl_graph_ms"] = bench_graph_ms(
            lambda: ok.decode_attention(q, cache, ep, bt, sl, ws, backend="triton", impl="tl")
        )
    # kernels only (split + merge, q already rotated)
    q_rot = ok.rotate_queries(q, ep)
    ns = ok.choose_num_splits(bsz, hkv, ctx, DEV, bn, pps)
    row["num_splits"] = ns

    def kernels():
        return dec_mod._launch_decode(
            q_rot, cache, bt, sl, ws, 1 / math.sqrt(d), g, dec_mod.SplitLaunch(ns, bn, nw, 2), impl=impl
        )

    kernels()
    kern = dec_mod.LAST_COMPILED.get("decode_split")
    if kern is not None and ctx == 131072 and bsz == 8:
        row["decode_kernel_diag"] = _ptx_diag(kern)
        with open(os.path.join(OUT_DIR, "decode_split.ptx"), "w") as f:
            f.write(kern.asm.get("ptx", ""))
    row["int2_kernels_ms"] = bench_ms(kernels)
    row["int2_kernels_graph_ms"] = bench_graph_ms(kernels)
    if kern is not None:  # the split kernel this shape ran: path and static counts
        ptx = kern.asm.get("ptx", "")
        row["split_kernel"] = dict(
            ring="cp.async" in ptx,
            copies_16B="cp.async.cg.shared.global" in ptx,
            n_regs=kern.n_regs,
            n_spills=kern.n_spills,
            shared_bytes=getattr(kern.metadata, "shared", None),
        )
    if tune and cfg:  # the default launch's split + merge too (the bandwidth target is the default's)
        _, bn0, nw0, pps0 = dec_mod.resolve_launch(cache, q, "auto")
        bn0 = dec_mod.gluon_block_n(bsz, lo, ctx, DEV, pps0) if impl == "gluon" else bn0
        ns0 = ok.choose_num_splits(bsz, hkv, ctx, DEV, bn0, pps0)
        row["default_num_splits"] = ns0
        row["default_kernels_graph_ms"] = bench_graph_ms(
            lambda: dec_mod._launch_decode(
                q_rot,
                cache,
                bt,
                sl,
                ws,
                1 / math.sqrt(d),
                g,
                dec_mod.SplitLaunch(ns0, bn0, nw0, 2),
                impl=impl,
            )
        )
    cache = None
    if "default_kernels_graph_ms" in row:
        row["default_kernels_graph_bw_frac"] = (
            row["bytes_int2_path"] / (row["default_kernels_graph_ms"] * 1e-3) / (copy_gbs * 1e9)
        )
    # BF16 baselines
    k = torch.randn(bsz, hkv, ctx, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    qs = q.unsqueeze(2)
    F = torch.nn.functional
    row["sdpa_bf16_ms"] = bench_ms(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True))
    k = v = None
    kp = torch.randn(num_pages, hkv, page, d, device=DEV, dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    row["paged_bf16_ms"] = bench_ms(
        lambda: ok.paged_bf16_decode(
            q, kp, vp, bt, sl, num_splits=ok.choose_num_splits(bsz, hkv, ctx, DEV, 64)
        )
    )
    kp = vp = None
    torch.cuda.empty_cache()
    bw = copy_gbs * 1e9
    row["int2_bw_frac"] = row["bytes_int2_path"] / (row["int2_kernels_ms"] * 1e-3) / bw
    row["int2_op_bw_frac"] = row["bytes_int2_path"] / (row["int2_ms"] * 1e-3) / bw
    row["sdpa_bw_frac"] = bytes_bf16 / (row["sdpa_bf16_ms"] * 1e-3) / bw
    row["paged_bf16_bw_frac"] = bytes_bf16 / (row["paged_bf16_ms"] * 1e-3) / bw
    row["speedup_vs_sdpa"] = row["sdpa_bf16_ms"] / row["int2_ms"]
    row["speedup_vs_sdpa_graph"] = row["sdpa_bf16_ms"] / row["int2_graph_ms"]
    row["speedup_vs_paged_bf16"] = row["paged_bf16_ms"] / row["int2_ms"]
    row["int2_kernels_graph_bw_frac"] = row["bytes_int2_path"] / (row["int2_kernels_graph_ms"] * 1e-3) / bw
    log(json.dumps(row))
    return row


def bench_write(n, copy_gbs, log):
    hkv, d = 8, 128
    lo = ok.CacheLayout(hkv, d, page_size=64)
    num_pages = math.ceil(n / 64) + 1
    gen = torch.Generator().manual_seed(n)
    cache = ok.allocate_cache(lo, num_pages, 1, DEV)
    ep = make_params(hkv, d, "layer", gen).expand(hkv, d, DEV)
    k = torch.randn(n, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(num_pages * 64, device=DEV)[:n]
    pos = torch.arange(n, device=DEV, dtype=torch.int32) + 100000  # outside the windows
    sidx = torch.zeros(n, dtype=torch.int32, device=DEV)
    sl = torch.tensor([200000], dtype=torch.int32, device=DEV)
    ws = torch.zeros(1, dtype=torch.int32, device=DEV)
    out = {"tokens": n}
    for prec in (False, True):
        ms = bench_ms(
            lambda prec=prec: ok.paged_write(
                cache, ep, k, v, slots, pos, sidx, sl, ws, backend="triton", precise=prec
            )
        )
        nbytes = n * hkv * (2 * d * 2 + 2 * (d // 4 + 4))
        key = "ieee" if prec else "tf32"
        out[f"{key}_graph_ms"] = bench_graph_ms(
            lambda prec=prec: ok.paged_write(
                cache, ep, k, v, slots, pos, sidx, sl, ws, backend="triton", precise=prec
            )
        )
        out[f"{key}_ms"] = ms
        out[f"{key}_tokens_per_s"] = n / (ms * 1e-3)
        out[f"{key}_bw_frac"] = nbytes / (ms * 1e-3) / (copy_gbs * 1e9)
    log(json.dumps(out))
    return out


def bench_prefill(prefix, chunk, log):
    hkv, g, d = 8, 4, 128
    lo = ok.CacheLayout(hkv, d, page_size=64)
    total = prefix + chunk
    num_pages = math.ceil(total / 64)
    gen = torch.Generator().manual_seed(prefix)
    cache = ok.allocate_cache(lo, num_pages, 1, DEV)
    fill_random(cache)
    ep = make_params(hkv, d, "layer", gen).expand(hkv, d, DEV)
    bt = torch.arange(num_pages, device=DEV, dtype=torch.int32)[None]
    q = torch.randn(chunk, hkv * g, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(chunk, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0, chunk], dtype=torch.int32, device=DEV)
    pl = torch.tensor([prefix], dtype=torch.int32, device=DEV)
    ws = torch.zeros(1, dtype=torch.int32, device=DEV)
    row = {"prefix": prefix, "chunk": chunk}
    row["int2_extend_ms"] = bench_ms(
        lambda: ok.extend_attention(q, k, v, cache, ep, cu, pl, bt, ws, chunk, backend="triton")
    )
    # BF16 baseline of the same shape: chunk queries over prefix + chunk keys, causal, SDPA
    kf = torch.randn(1, hkv, total, d, device=DEV, dtype=torch.bfloat16)
    vf = torch.randn_like(kf)
    qf = q.transpose(0, 1).unsqueeze(0)
    mask = torch.arange(total, device=DEV)[None, :] <= (prefix + torch.arange(chunk, device=DEV))[:, None]
    F = torch.nn.functional
    row["sdpa_bf16_masked_ms"] = bench_ms(
        lambda: F.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask, enable_gqa=True)
    )
    # full causal BF16 prefill of the whole length with flash (upper bound on work)
    qa = torch.randn(1, hkv * g, total, d, device=DEV, dtype=torch.bfloat16)
    row["sdpa_bf16_full_causal_ms"] = bench_ms(
        lambda: F.scaled_dot_product_attention(qa, kf, vf, is_causal=True, enable_gqa=True)
    )
    flops = 4 * chunk * (prefix + chunk / 2) * d * hkv * g
    row["int2_extend_tflops"] = flops / (row["int2_extend_ms"] * 1e-3) / 1e12
    row["speedup_vs_sdpa_masked"] = row["sdpa_bf16_masked_ms"] / row["int2_extend_ms"]
    log(json.dumps(row))
    cache = kf = vf = qa = None
    torch.cuda.empty_cache()
    return row


def _int2_decode_setup(ctx, bsz, hkv=8, g=4, d=128, page=64, width=None, gran="layer"):
    """A random cache of ``bsz`` sequences of ``ctx`` tokens in scattered pages; ``width``: block-table
    width in tokens (an engine's table is as wide as ``max_model_len``; unused columns page 0)."""
    lo = ok.CacheLayout(hkv, d, page_size=page)
    used = -(-ctx // page)
    num_pages = bsz * used
    gen = torch.Generator().manual_seed(ctx + bsz)
    cache = ok.allocate_cache(lo, num_pages, bsz, DEV)
    fill_random(cache)
    bt = torch.zeros(bsz, max(used, (width or 0) // page), dtype=torch.int32, device=DEV)
    bt[:, :used] = torch.randperm(num_pages, device=DEV).int().reshape(bsz, used)
    sl = torch.full((bsz,), ctx, dtype=torch.int32, device=DEV)
    ws = torch.arange(bsz, dtype=torch.int32, device=DEV)
    ep = make_params(hkv, d, gran, gen).expand(hkv, d, DEV)
    q = torch.randn(bsz, hkv * g, d, device=DEV, dtype=torch.bfloat16)
    nbytes = bsz * hkv * (ctx - lo.window_tokens) * 2 * (d // 4 + 4) + bsz * hkv * lo.window_tokens * d * 4
    return dict(
        cache=cache, bt=bt, sl=sl, ws=ws, ep=ep, q=q, q_rot=ok.rotate_queries(q, ep), g=g, d=d, nbytes=nbytes
    )


def _ptx_diag(kern):
    """Static counts of a compiled kernel: what the tile loop is made of, registers, spills."""
    ptx = kern.asm.get("ptx", "")
    keys = (
        "prmt.b32",
        "lop3",
        "st.shared",
        "ld.shared",
        "ldmatrix",
        "mma.sync",
        "wgmma",
        "bar.sync",
        "shfl.sync",
        "ld.global.v2.b32",
        "ld.global.b32",
        "ld.global.b16",
        "ld.global.b8",
        "cp.async.cg.shared.global",
        "cp.async.ca.shared.global",
    )
    out = {k: ptx.count(k) for k in keys}
    out.update(
        n_regs=kern.n_regs, n_spills=kern.n_spills, shared_bytes=getattr(kern.metadata, "shared", None)
    )
    return out


# ----------------------------------------------------------------------------- impl="gluon" vs "tl"
IMPL_CHECKS = [
    # name, d, H_kv, gqa, page, group, lens[, mode, (sink, recent)]   (random cache contents, no writes)
    ("impl-mixed-128", 128, 8, 4, 64, None, [0, 1, 63, 64, 320, 321, 385, 1000, 4097]),
    ("impl-gqa8-d128", 128, 2, 8, 16, None, [0, 17, 65, 500, 2049]),
    ("impl-gqa3-d128", 128, 3, 3, 32, None, [5, 300, 777, 3000]),
    ("impl-gqa1-d256", 256, 2, 1, 16, None, [321, 2000, 99]),
    ("impl-gqa16-d128-page8", 128, 1, 16, 8, None, [1, 700, 1234]),
    ("impl-128k-gqa4", 128, 8, 4, 64, None, [131072, 100003]),
    ("impl-128k-gqa8", 128, 4, 8, 64, None, [131072, 65]),
    # the 128k x 8 benchmark launch (64-token tiles, 16-byte cp.async ring by the op's rule)
    ("impl-128k-b8-default", 128, 8, 4, 64, None, [131072] * 7 + [100003]),
    # discriminating cases (which part of a kernel is wrong): windows alone, INT2 alone,
    # the value path alone (all scores 0: uniform attention), the key path alone (INT2
    # values = their zero point, so the output depends on the scores but not on value codes)
    ("dbg-windows-only", 128, 2, 4, 16, None, [1, 17, 64, 200, 320], "random", (64, 256)),
    ("dbg-int2-only", 128, 2, 4, 16, None, [1, 17, 64, 200, 2000], "random", (0, 0)),
    ("dbg-v-only", 128, 2, 4, 16, None, [1, 300, 2000], "v-only", (64, 256)),
    ("dbg-k-only", 128, 2, 4, 16, None, [1, 300, 2000], "k-only", (64, 256)),
]


def fill_random(cache, scale_lo=0.01, scale_hi=0.1):
    """Random codes, scales in ``[scale_lo, scale_hi)``, normal zeros and windows (never zeros)."""
    for t in (cache.k_codes, cache.v_codes):
        t.random_(0, 256)
    for t in (cache.k_scale, cache.v_scale):
        t.uniform_(scale_lo, scale_hi)
    for t in (cache.k_zero, cache.v_zero, cache.k_sink, cache.v_sink, cache.k_recent, cache.v_recent):
        t.normal_()


def random_cache(lo, lens, gen, scale_lo=0.01, scale_hi=0.1, mode="random"):
    """A cache with random codes / scales / zeros / windows and scattered pages.

    ``mode``: ``random``; ``v-only`` (keys all zero: every score 0); ``k-only`` (value
    scales 0: an INT2 value is its zero point, whatever its codes).
    """
    bsz = len(lens)
    pages_per = [max(1, math.ceil(n / lo.page_size)) for n in lens]
    num_pages = sum(pages_per) + 3
    perm = torch.randperm(num_pages, generator=gen)
    bt = torch.zeros(bsz, max(pages_per) + 1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages_per):
        bt[b, :n] = perm[i : i + n].int()
        i += n
    ws = torch.randperm(bsz + 2, generator=gen)[:bsz].int()
    cache = ok.allocate_cache(lo, num_pages, bsz + 2, DEV)
    fill_random(cache, scale_lo, scale_hi)
    if mode == "v-only":
        for t in (cache.k_scale, cache.k_zero, cache.k_sink, cache.k_recent):
            t.zero_()
    elif mode == "k-only":
        cache.v_scale.zero_()
    return cache, bt.to(DEV), ws.to(DEV)


def check_impls(name, d, hkv, g, page, group, lens, mode="random", win=(64, 256), *, seed, log, cfgs=None):
    """Decode with impl="tl" and impl="gluon" (each Gluon launch config of ``cfgs``; outputs
    NaN-poisoned) vs float64 attention over the cache contents."""
    gen = torch.Generator().manual_seed(seed)
    lo = ok.CacheLayout(hkv, d, page_size=page, group_size=group, sink_tokens=win[0], recent_tokens=win[1])
    cache, bt, ws = random_cache(lo, lens, gen, mode=mode)
    ep = make_params(hkv, d, "layer", gen).expand(hkv, d, DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(len(lens), hkv * g, d, generator=gen).to(DEV, torch.bfloat16)
    res = {"case": name, "d": d, "H_kv": hkv, "gqa": g, "page": page, "group": lo.group, "lens": lens}
    outs = {}
    runs = {"tl": dict(impl="tl")}
    why = dec_mod.gluon_unavailable_reason(cache, q)
    if why is None:
        for c in cfgs or [{}]:
            runs["gluon" + "".join(f"/{k}={v}" for k, v in c.items())] = dict(impl="gluon", **c)
    else:
        res["gluon_skipped"] = why
    dec_mod._empty = _poison
    try:
        for key, kw in runs.items():
            outs[key] = ok.decode_attention(q, cache, ep, bt, sl, ws, backend="triton", **kw).double()
    finally:
        dec_mod._empty = torch.empty
    qr = ok.rotate_queries(q, ep).double()
    errs = dict.fromkeys(outs, 0.0)
    for b, n in enumerate(lens):
        if n == 0:
            for k in errs:
                errs[k] = max(errs[k], float(outs[k][b].abs().max()))
            continue
        kk, vv = ok.gather_rotated_kv(cache, bt[b], int(ws[b]), n, n, dtype=torch.float64)
        want = unrot64(dense64(qr[b : b + 1], kk, vv, 1 / math.sqrt(d)), ep)[0]
        for k in errs:
            errs[k] = max(errs[k], rel(outs[k][b], want))
    res.update(
        rel_err=errs,
        vs_tl={k: rel(o, outs["tl"]) for k, o in outs.items() if k != "tl"},
        finite={k: bool(torch.isfinite(o).all()) for k, o in outs.items()},
    )
    res["pass"] = bool(all(res["finite"].values()) and max(errs.values()) < 1e-2)
    log(json.dumps(res))
    return res


def run_impl_checks(log, cfgs=None):
    out = []
    for i, c in enumerate(IMPL_CHECKS):
        t = time.time()
        try:
            r = check_impls(*c, seed=300 + i, log=log, cfgs=cfgs)
        except Exception as e:
            log(f"CHECK {c[0]} FAILED: {traceback.format_exc()}")
            r = {"case": c[0], "pass": False, "error": repr(e)}
        r["seconds"] = round(time.time() - t, 1)
        out.append(r)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="skip the write / prefill benchmarks")
    ap.add_argument(
        "--gluon",
        action="store_true",
        help="Gluon decode kernel wherever it serves (the default; undoes OSCAR_GLUON_DECODE=0)",
    )
    ap.add_argument("--shapes", nargs="*", default=None, help="decode shapes as CTX:B (default all nine)")
    ap.add_argument("--cases", nargs="*", default=None)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.gluon:
        os.environ["OSCAR_GLUON_DECODE"] = "1"
    global OUT_DIR
    OUT_DIR = a.out
    logf = open(os.path.join(a.out, "gpu_run.log"), "a")

    def log(s):
        print(s, flush=True)
        logf.write(s + "\n")
        logf.flush()

    import triton

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = "?"
    cuda = DEV.type == "cuda"
    env = {
        "gpu": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else 0,
    }
    log(json.dumps(env))
    copy_gbs = copy_bandwidth_gbs() if cuda else 1.0
    env["copy_GBps"] = copy_gbs
    log(f"copy bandwidth (read+write): {copy_gbs:.0f} GB/s")
    checks = []
    if not a.skip_check:
        checks = run_checks(log, a.quick, a.cases)
        json.dump({"env": env, "checks": checks}, open(os.path.join(a.out, "check.json"), "w"), indent=1)
        impl_cfgs = [{}] if not a.tune else [dict(block_n=64, num_stages=1), {}]
        checks += run_impl_checks(log, impl_cfgs)
        json.dump({"env": env, "checks": checks}, open(os.path.join(a.out, "check.json"), "w"), indent=1)
    bench = {"env": env}
    if not a.skip_bench:
        tune = None
        if a.tune:  # Gluon launch configurations swept at 128k (the best is reported)
            tune = [{}] + [dict(block_n=bn, programs_per_sm=pps) for bn in (32, 64) for pps in (8, 12, 16)]
        shapes = [(c, b) for c in (8192, 32768, 131072) for b in (1, 8, 32)]
        if a.shapes:
            shapes = [tuple(int(x) for x in sh.split(":")) for sh in a.shapes]

        def safe(fn, *args, **kw):
            try:
                return fn(*args, **kw)
            except Exception:
                log(f"BENCH {fn.__name__}{args[:2]} FAILED: {traceback.format_exc()}")
                torch.cuda.empty_cache()
                return None

        bench["decode"] = []
        for c, b in shapes:  # saved after every shape: a cut-off call keeps what it measured
            r = safe(bench_decode, c, b, copy_gbs, log, tune if (c, b) == (131072, 8) else None)
            if r:
                bench["decode"].append(r)
            json.dump(bench, open(os.path.join(a.out, "bench.json"), "w"), indent=1)
        if a.decode_only:
            print_tables(checks, bench, copy_gbs)
            return
        bench["write"] = [r for r in (safe(bench_write, n, copy_gbs, log) for n in (32, 4096, 65536)) if r]
        pre = (safe(bench_prefill, p, c, log) for p, c in ((8192 - 2048, 2048), (32768 - 4096, 4096)))
        bench["prefill"] = [r for r in pre if r]
        json.dump(bench, open(os.path.join(a.out, "bench.json"), "w"), indent=1)
    print_tables(checks, bench, copy_gbs)


def _row(fmt: str, r: dict) -> str:
    return fmt.format(**r)


def print_tables(checks, bench, copy_gbs):
    """The short tables printed last (the device tool returns the end of the output)."""
    print("\n== checks ==")
    for r in checks:
        if "error" in r:
            print(f"{r['case']:16s} ERROR {r['error'][:100]}")
            continue
        if "rel_err" in r:  # impl checks: every kernel vs float64 over the cache
            errs = " ".join(f"{k}={e:.1e}" for k, e in r["rel_err"].items())
            print(f"{r['case']:22s} pass={r['pass']} d={r['d']} gqa={r['gqa']} {errs} {r['seconds']}s")
            continue
        print(
            _row(
                "{case:16s} pass={pass} dec_err={decode_rel_err_vs_f64_cache:.1e} "
                "raw={decode_rel_err_vs_f64_raw:.1e} ext_err={extend_rel_err_vs_f64_cache:.1e} "
                "kmis={k_code_mismatch:.1e} vmis={v_code_mismatch:.1e} {seconds}s",
                r,
            )
        )
    if "decode" not in bench:
        return
    print(f"\n== decode (copy {copy_gbs:.0f} GB/s) ==")
    print(
        "ctx     B  int2_us graph_us kern_us kgraph_us bw%  tl_graph_us sdpa_us sdpa_bw% pagedbf16_us "
        " x_sdpa x_sdpa_graph x_paged  cfg"
    )
    for r in bench["decode"]:
        v = {
            k: (x * 1e3 if k.endswith("_ms") else x * 100 if k.endswith("_frac") else x) for k, x in r.items()
        }
        v.setdefault("tl_graph_ms", float("nan"))
        v["cfg"] = "/".join(str(x) for x in r["int2_cfg"].values()) + f"/ns={r['num_splits']}"
        sk = r.get("split_kernel", {})
        if sk:
            path = "ring16B" if sk.get("copies_16B") else "ring" if sk.get("ring") else "plain"
            v["cfg"] += f"/{path}/{sk.get('n_regs')}r"
        print(
            _row(
                "{ctx:6d} {batch:3d} {int2_ms:8.1f} {int2_graph_ms:8.1f} {int2_kernels_ms:7.1f} "
                "{int2_kernels_graph_ms:8.1f} {int2_kernels_graph_bw_frac:4.0f} {tl_graph_ms:9.1f} "
                "{sdpa_bf16_ms:8.1f} {sdpa_bw_frac:6.0f} {paged_bf16_ms:10.1f} {speedup_vs_sdpa:7.2f} "
                "{speedup_vs_sdpa_graph:7.2f} {speedup_vs_paged_bf16:7.2f}  {cfg}",
                v,
            )
        )
    for r in bench["decode"]:
        if "decode_kernel_diag" in r:
            print("decode kernel (128k x 8):", r["decode_kernel_diag"])
        if "tune_graph_us" in r:
            print(
                f"tune {r['ctx']} x {r['batch']} (graph us):",
                {k: round(x, 1) for k, x in r["tune_graph_us"].items()},
            )
        if "default_kernels_graph_ms" in r:
            print(
                f"default launch {r['ctx']} x {r['batch']}: split+merge graph "
                f"{r['default_kernels_graph_ms'] * 1e3:.1f} us = "
                f"{r['default_kernels_graph_bw_frac'] * 100:.1f} % of copy"
            )
    if "write" not in bench:
        return
    print("\n== write ==")
    for r in bench["write"]:
        v = {
            k: (x * 1e3 if k.endswith("_ms") else x * 100 if k.endswith("_frac") else x) for k, x in r.items()
        }
        v["mtok"] = r["tf32_tokens_per_s"] / 1e6
        print(
            _row(
                "N={tokens:6d} tf32 {tf32_ms:8.1f} us (graph {tf32_graph_ms:7.1f}) {mtok:8.2f} Mtok/s "
                "bw {tf32_bw_frac:.0f}%  | ieee {ieee_ms:8.1f} us bw {ieee_bw_frac:.1f}%",
                v,
            )
        )
    print("\n== prefill ==")
    for r in bench["prefill"]:
        print(
            _row(
                "prefix={prefix} chunk={chunk} int2 {int2_extend_ms:.3f} ms "
                "({int2_extend_tflops:.0f} TFLOP/s) "
                "sdpa_masked {sdpa_bf16_masked_ms:.3f} ms full_causal {sdpa_bf16_full_causal_ms:.3f} ms "
                "x{speedup_vs_sdpa_masked:.2f}",
                r,
            )
        )


if __name__ == "__main__":
    main()
