"""Pre-RoPE key mean (artifact format version 3) in decode / extend attention.

INT2 rows are stored centred by ``RoPE_p(m)``; attention adds ``q · RoPE_p(m)`` back to the
score of every INT2 key (:mod:`oscar_math.rope_center`). The torch references add
``RoPE_p(m) @ R_K`` to the dequantised INT2 rows; the kernels add the per-key score term.
Checked here: the kernels (tl under the interpreter on CPU; tl and every Gluon build on a GPU)
against the references, the references against attention over the *un-centred* keys, the
kernels' angle reduction at 128k positions, the custom op, graph capture, and that a zero mean
changes nothing bit for bit.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import replace

import pytest
import torch
from conftest import DEVICE, HAS_TRITON, fill_cache, needs_triton

from oscar_kernels import (
    CacheLayout,
    LayerQuantParams,
    decode_attention,
    decode_attention_ref,
    extend_attention,
    extend_attention_ref,
)
from oscar_kernels._backend import dot_dtype
from oscar_kernels.decode_attention import gluon_unavailable_reason
from oscar_kernels.reference.attention import rope_mean_rows
from oscar_math import dequantize_int2, quantize_int2
from oscar_math.rope_center import rope_position_mean

dec = importlib.import_module("oscar_kernels.decode_attention")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def inv_freq(d: int) -> torch.Tensor:
    """Realistic RoPE inverse frequencies ``10000^(-2i/d)``."""
    return 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


def with_rope(params: LayerQuantParams, h: int, d: int, pairs: int, gen: torch.Generator, amp: float = 3.0):
    """``params`` plus a pre-RoPE mean that is non-zero on ``pairs`` random pairs (all of them
    for ``d/2``; different per KV head), amplitude ``amp`` (so the score term matters)."""
    half = d // 2
    sel = torch.randperm(half, generator=gen)[:pairs]
    m = torch.zeros(h, d)
    m[:, sel] = amp * torch.randn(h, pairs, generator=gen)
    m[:, sel + half] = amp * torch.randn(h, pairs, generator=gen)
    return dataclasses.replace(params, k_rope_mean=m, k_rope_inv_freq=inv_freq(d).float())


def without_term(ep):
    return dataclasses.replace(
        ep, k_rope_mean=None, k_rope_inv_freq=None, k_rope_ab=None, k_rope_theta=None, k_rope_pairs=None
    )


# ----------------------------------------------------------------------------- decode
DECODE_CASES = [
    # d, h, g, page, group, granularity, splits, pairs
    (64, 2, 4, 16, None, "layer", 3, 1),
    (64, 1, 3, 8, 32, "kv_head", 2, 2),  # group < d, GQA 3
    (128, 2, 4, 16, None, "kv_head", 4, 8),
    (128, 1, 8, 8, None, "layer", 1, 64),  # all pairs (R = d/2)
    (256, 2, 1, 16, None, "kv_head", 2, 8),
]


@needs_triton
@pytest.mark.parametrize("impl", ["tl", "gluon"])
@pytest.mark.parametrize("d, h, g, page, group, granularity, splits, pairs", DECODE_CASES)
def test_decode_rope_matches_reference(d, h, g, page, group, granularity, splits, pairs, impl):
    gen = torch.Generator().manual_seed(7 * d + pairs)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=5, recent_tokens=12)
    # empty, < sink, INT2 range empty (= sink + recent), one INT2 row, page boundaries, longer
    lens = [0, 3, 17, 18, 2 * page, 2 * page + 1, 83]
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, granularity, steps=2)
    if impl == "gluon" and (why := gluon_unavailable_reason(cache)) is not None:
        pytest.skip(f"Gluon kernel cannot run here: {why}")
    ep = with_rope(params, h, d, pairs, gen).expand(h, d, cache.device)
    assert ep.rope_pairs == pairs
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), h * g, d, generator=gen).bfloat16().to(DEVICE)
    out = decode_attention(
        q, cache, ep, bt, sl, ws, backend="triton", num_splits=splits,
        block_n=16 if impl == "tl" else 32, impl=impl,
    )  # fmt: skip
    ref = decode_attention_ref(q, cache, ep, bt, sl, ws)
    plain = decode_attention_ref(q, cache, without_term(ep), bt, sl, ws)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    for b in range(1, len(lens)):
        assert rel(out[b], ref[b]) < 1e-2, (b, lens[b], rel(out[b], ref[b]))
    # the term matters wherever there are INT2 keys (so the check above has power), and only there
    assert rel(ref[-1], plain[-1]) > 5e-2, rel(ref[-1], plain[-1])
    assert all(rel(ref[b], plain[b]) > 1e-3 for b, n in enumerate(lens) if n > lo.window_tokens)
    for b, n in enumerate(lens[1:], 1):
        if n <= lo.window_tokens:
            assert torch.equal(ref[b], plain[b])


@needs_triton
@pytest.mark.parametrize("impl", ["tl", "gluon"])
@pytest.mark.parametrize("pairs", [8, 64])
def test_decode_rope_long_positions(monkeypatch, impl, pairs):
    """Positions into the tens of thousands with realistic θ (all 64 pairs of d = 128: angles up
    to 4e4 rad): 41k and 20k tokens on a GPU, 20k interpreted (one sequence, large tiles)."""
    gen = torch.Generator().manual_seed(pairs)
    gpu = DEVICE.type == "cuda"
    lo = CacheLayout(2, 128, page_size=64 if gpu else 256, sink_tokens=64, recent_tokens=256)
    lens = [41003, 20000, 333] if gpu else [20011]
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, "kv_head")
    if impl == "gluon" and (why := gluon_unavailable_reason(cache)) is not None:
        pytest.skip(f"Gluon kernel cannot run here: {why}")
    ep = with_rope(params, 2, 128, pairs, gen).expand(2, 128, cache.device)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), 8, 128, generator=gen).bfloat16().to(DEVICE)
    ref = decode_attention_ref(q, cache, ep, bt, sl, ws)
    plain = decode_attention_ref(q, cache, without_term(ep), bt, sl, ws)
    kw = {} if gpu else dict(block_n=128)
    # Gluon, R = 8: by angle addition (forced on 32-token tiles) and one angle per element (the
    # rule there); R = 64: one angle per element
    for min_bn in (0, 1 << 30) if impl == "gluon" and pairs == 8 else (None,):
        tuning = (
            dec.DEFAULT_TUNING
            if min_bn is None
            else replace(dec.DEFAULT_TUNING, rope_addition_min_block_n=min_bn)
        )
        for splits in (None, 7) if gpu else (5,):
            out = decode_attention(
                q, cache, ep, bt, sl, ws, backend="triton", num_splits=splits, impl=impl, tuning=tuning, **kw
            )
            for b in range(len(lens)):
                assert rel(out[b], ref[b]) < 1e-2, (min_bn, b, splits, rel(out[b], ref[b]))
    assert rel(ref[0], plain[0]) > 5e-2


@needs_triton
@pytest.mark.skipif(DEVICE.type != "cuda", reason="runs the Gluon kernel: needs an NVIDIA GPU")
@pytest.mark.parametrize("variant", ["prefetch", "no-prefetch", "ring-narrow", "ring-wide", "ring-wide-64"])
@pytest.mark.parametrize("pairs", [1, 64])
def test_gluon_rope_builds_match_reference(monkeypatch, variant, pairs):
    """Every Gluon build the op launches, with the term (R = 1: by angle addition, forced on
    32-token tiles too; R = 64: one angle per element): register prefetch (and none), the
    ``cp.async`` ring with 4-8-byte and 16-byte copies, 64-token tiles; 1 … 9 splits."""
    tuning = replace(
        dec.DEFAULT_TUNING,
        rope_addition_min_block_n=0,
        async_min_tiles=0 if variant.startswith("ring") else 1 << 30,
        async_wide_min_waves=0 if "wide" in variant else None,
    )
    sink = 64 if variant == "ring-wide-64" else 32
    lo = CacheLayout(2, 128, page_size=64, sink_tokens=sink, recent_tokens=40)
    lens = [0, 3, 33, 72, 95, 160, 257, 1001, 2049]
    gen = torch.Generator().manual_seed(pairs + len(variant))
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, "kv_head", steps=2)
    if (why := gluon_unavailable_reason(cache)) is not None:
        pytest.skip(f"Gluon kernel cannot run here: {why}")
    ep = with_rope(params, 2, 128, pairs, gen).expand(2, 128, cache.device)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), 8, 128, generator=gen).bfloat16().to(DEVICE)
    ref = decode_attention_ref(q, cache, ep, bt, sl, ws)
    kw = dict(block_n=64) if variant == "ring-wide-64" else {}
    stages = 1 if variant == "no-prefetch" else 2
    for splits in (1, 4, 9):
        out = decode_attention(
            q, cache, ep, bt, sl, ws, backend="triton", num_splits=splits, impl="gluon",
            num_stages=stages, tuning=tuning, **kw,
        )  # fmt: skip
        assert torch.isfinite(out).all() and out[0].abs().max() == 0
        for b in range(1, len(lens)):
            assert rel(out[b], ref[b]) < 1e-2, (splits, b, rel(out[b], ref[b]))
        ptx = dec.LAST_COMPILED["decode_split"].asm["ptx"]
        assert ("cp.async" in ptx) == variant.startswith("ring") and "cos.approx.f32" in ptx


@needs_triton
@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("impl", ["tl", "gluon"])
def test_decode_rope_under_graph_capture(impl):
    """The coefficients are computed on the device inside the op: a captured graph replays the
    term for new queries (no host synchronisation, no stale coefficients)."""
    gen = torch.Generator().manual_seed(3)
    lo = CacheLayout(2, 128, page_size=64, sink_tokens=64, recent_tokens=64)
    lens = [700, 1500]
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, "kv_head")
    if impl == "gluon" and (why := gluon_unavailable_reason(cache)) is not None:
        pytest.skip(f"Gluon kernel cannot run here: {why}")
    ep = with_rope(params, 2, 128, 8, gen).expand(2, 128, cache.device)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 8, 128, generator=gen).bfloat16().to(DEVICE)

    def step():
        return decode_attention(q, cache, ep, bt, sl, ws, backend="triton", impl=impl)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    q.copy_(torch.randn(2, 8, 128, generator=gen).bfloat16().to(DEVICE))
    graph.replay()
    ref = decode_attention_ref(q, cache, ep, bt, sl, ws)
    assert rel(out, ref) < 1e-2


@needs_triton
@pytest.mark.parametrize("impl", ["tl", "gluon"])
def test_zero_rope_mean_changes_nothing(impl):
    """A pre-RoPE mean of zeros (one padding slot: a = b = θ = 0) runs the term's code path and
    gives the same bits as no mean at all: the term adds exact zeros."""
    gen = torch.Generator().manual_seed(4)
    lo = CacheLayout(2, 128, page_size=16, sink_tokens=5, recent_tokens=12)
    lens = [0, 17, 18, 95]
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, "kv_head", steps=1)
    if impl == "gluon" and (why := gluon_unavailable_reason(cache)) is not None:
        pytest.skip(f"Gluon kernel cannot run here: {why}")
    if impl == "tl" and DEVICE.type == "cpu" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    zero = dataclasses.replace(params, k_rope_mean=torch.zeros(2, 128), k_rope_inv_freq=inv_freq(128).float())
    ep0 = params.expand(2, 128, cache.device)
    epz = zero.expand(2, 128, cache.device)
    assert ep0.rope_pairs == 0 and epz.rope_pairs == 1
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), 8, 128, generator=gen).bfloat16().to(DEVICE)
    kw = dict(backend="triton", num_splits=3, impl=impl, block_n=16 if impl == "tl" else 32)
    a = decode_attention(q, cache, ep0, bt, sl, ws, **kw)
    b = decode_attention(q, cache, epz, bt, sl, ws, **kw)
    if impl == "tl" and DEVICE.type == "cuda":
        # a different compiled kernel: the compiler may contract the score epilogue differently,
        # and one float32 ulp moved flips bf16 roundings of the output (one bf16 ulp is 2^-8
        # relative): bit-exact and 1e-5 both failed on the H200 (2026-12-01); the term's
        # correctness on the GPU is checked against the reference by the tests above
        d = rel(b, a)
        print(f"tl on the GPU: rel(zero mean, no mean) = {d:.3e}")
        assert d < 4e-3, d
    else:
        assert torch.equal(a, b)
    if impl == "gluon":  # the term's code really ran in the second call
        assert "cos.approx.f32" in dec.LAST_COMPILED["decode_split"].asm["ptx"]


@needs_triton
@pytest.mark.parametrize("mode", [1, 2])
def test_gluon_rope_term_compiles_for_sm90(mode):
    """The Gluon kernel with the term (R = 8) compiles for sm_90 on CPU CI: three tf32 ``mma``
    per k-step of the term, ``cos.approx`` (and ``sin.approx`` for the angle addition), no local
    memory; the unpack and the codes' tensor-core path unchanged."""
    from test_decode_attention import _gluon_ptx_or_skip

    ptx = _gluon_ptx_or_skip(gqa=4, head_dim=128, block_n=64, rope_pairs=8, rope_mode=mode)
    tf32 = ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")
    assert tf32 == 3 * 4 * 2  # passes x (64 tokens / 16) x (K = 16 / 8)
    assert "cos.approx.f32" in ptx and ("sin.approx.f32" in ptx) == (mode == 2)
    assert ".local" not in ptx and "mma.sync.aligned.m16n8k16" in ptx and "0x00C000C0" in ptx


# ----------------------------------------------------------------------------- extend
@needs_triton
@pytest.mark.parametrize(
    "d, h, g, page, group, granularity, pairs",
    [(64, 2, 2, 16, None, "layer", 2), (64, 1, 4, 8, 16, "kv_head", 8), (128, 1, 3, 16, None, "kv_head", 64)],
)
def test_extend_rope_matches_reference(d, h, g, page, group, granularity, pairs):
    gen = torch.Generator().manual_seed(d + pairs)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=4, recent_tokens=10)
    lens = [7, 16, 45, 70]
    chunks = [7, 1, 20, 33]  # first chunk (no INT2 keys), decode-like, chunk > recent, long chunk
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, granularity, pending=chunks)
    ep = with_rope(params, h, d, pairs, gen).expand(h, d, cache.device)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    prefix = [n - c for n, c in zip(lens, chunks, strict=True)]
    prefix = torch.tensor(prefix, dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(chunks), h * g, d, generator=gen).bfloat16().to(DEVICE)
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([values[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    args = (q, k, v, cache)
    rest = (cu, prefix, bt, ws, max(chunks))
    out = extend_attention(*args, ep, *rest, backend="triton", block_m=16, block_n=16)
    ref = extend_attention_ref(*args, ep, *rest)
    plain = extend_attention_ref(*args, without_term(ep), *rest)
    assert torch.isfinite(out).all()
    for b in range(len(lens)):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        assert rel(out[s0:s1], ref[s0:s1]) < 1e-2, (b, rel(out[s0:s1], ref[s0:s1]))
    # queries that read INT2 keys (t - recent >= sink) feel the term; the first chunk's do not
    assert torch.equal(ref[:7], plain[:7])
    assert rel(ref[int(cu[3]) :], plain[int(cu[3]) :]) > 5e-2


# ----------------------------------------------------------------------------- reference
def test_reference_term_reconstructs_uncentred_keys():
    """End to end in torch: INT2 rows quantised from keys centred by ``RoPE_p(m)`` (what the
    write stores), windows un-centred. The reference's INT2 rows are then the original rotated
    keys up to the INT2 error of the centred rows (to float32 rounding), and its attention equals
    float64 attention over the *un-centred* keys in the original basis; dropping the term does not."""
    gen = torch.Generator().manual_seed(13)
    h, d, g = 2, 64, 2
    lo = CacheLayout(h, d, page_size=8, sink_tokens=3, recent_tokens=5)
    n = 41
    cache, params, bt, ws, keys, values = fill_cache(lo, [n], gen, "kv_head")
    ep = with_rope(params, h, d, 8, gen, amp=6.0).expand(h, d, cache.device)
    # the INT2 pages, rewritten from centred keys (the windows keep the un-centred rows)
    kr = torch.einsum("nhd,hde->nhe", keys[0].float() - ep.k_mean, ep.k_rotation)
    rm = rope_mean_rows(ep, n, cache.device)
    want_rm = torch.einsum(
        "nhd,hde->nhe", rope_position_mean(ep.k_rope_mean, torch.arange(n), ep.k_rope_inv_freq), ep.k_rotation
    )
    assert torch.allclose(rm, want_rm, atol=1e-5)
    qk = quantize_int2(kr - rm, lo.group, clip_ratio=ep.k_clip[:, None])
    j = torch.arange(n, device=DEVICE)
    page, off = bt[0].long()[j // lo.page_size], j % lo.page_size
    cache.k_codes[page, :, off] = qk.codes
    cache.k_scale[page, :, off] = qk.scale
    cache.k_zero[page, :, off] = qk.zero
    from oscar_kernels import gather_rotated_kv

    k_got, _ = gather_rotated_kv(cache, bt[0], int(ws[0]), n, n, ep=ep)
    k_plain, _ = gather_rotated_kv(cache, bt[0], int(ws[0]), n, n)
    q_int2 = slice(lo.sink_tokens, n - lo.recent_tokens)
    centred_err = (dequantize_int2(qk) - (kr - rm))[q_int2]
    assert torch.allclose(k_got[q_int2] - kr[q_int2], centred_err, atol=2e-5)
    assert (k_plain[q_int2] - kr[q_int2]).norm() > 2 * centred_err.norm()  # without the term: far off
    # attention, original basis, float64: un-centred keys = dequantised rows @ R_Kᵀ + mean + RoPE_p(m)
    rk = ep.k_rotation.double()
    k_orig = torch.einsum("nhe,hde->nhd", dequantize_int2(qk).double(), rk) + ep.k_mean.double()
    k_orig = k_orig + rope_position_mean(ep.k_rope_mean, torch.arange(n), ep.k_rope_inv_freq).double()
    win = (j < lo.sink_tokens) | (j >= n - lo.recent_tokens)
    k_orig[win] = torch.einsum("nhe,hde->nhd", k_got[win].double(), rk) + ep.k_mean.double()
    _, v_rot = gather_rotated_kv(cache, bt[0], int(ws[0]), n, n, dtype=torch.float64, ep=ep)
    v_orig = torch.einsum("nhe,hde->nhd", v_rot, ep.v_rotation.double())
    # float32 queries whose rotation the reference rounds to bf16 without loss: q = q_r @ R_Kᵀ
    q_r = torch.randn(1, h, g, d, generator=gen).bfloat16().double().to(DEVICE)
    q = (q_r @ rk.transpose(-1, -2)[None]).reshape(1, h * g, d).float()
    s = torch.einsum("hd,nhd->hn", q[0].double(), k_orig.repeat_interleave(g, 1)) / math.sqrt(d)
    want = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v_orig.repeat_interleave(g, 1))
    sl = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    got = decode_attention_ref(q, cache, ep, bt, sl, ws)[0]
    dropped = decode_attention_ref(q, cache, without_term(ep), bt, sl, ws)[0]
    assert rel(got, want) < 1e-5, rel(got, want)
    assert rel(dropped, want) > 1e-2, rel(dropped, want)


# ----------------------------------------------------------------------------- kernel pieces
if HAS_TRITON:
    import triton
    import triton.language as tl

    from oscar_kernels.kernels.attention import (
        _rope_angle,
        _rope_basis,
        _rope_cos_sin,
        _rope_load,
        _rope_scores,
        _theta_split,
    )

    @triton.jit
    def _rope_term_kernel(
        rc_ptr,
        th_ptr,
        acc_ptr,
        out_ptr,
        T0,
        M: tl.constexpr,
        R: tl.constexpr,
        P: tl.constexpr,
        N: tl.constexpr,
        DOT: tl.constexpr,
    ):
        m = tl.arange(0, M)
        n = tl.arange(0, N)
        rc0, rc1, th_hi, th_lo = _rope_load(rc_ptr, m * (2 * P), m < M, th_ptr, R, P)
        basis = _rope_basis(th_hi, th_lo, N, P)
        acc = tl.load(acc_ptr + m[:, None] * N + n[None, :])
        s = _rope_scores(rc0, rc1, th_hi, th_lo, basis, T0, acc, P, DOT)
        tl.store(out_ptr + m[:, None] * N + n[None, :], s)

    @triton.jit
    def _angles_kernel(
        p_ptr, th_ptr, a_ptr, c_ptr, s_ptr, N: tl.constexpr, R: tl.constexpr, DOT: tl.constexpr
    ):
        i = tl.arange(0, N)
        r = tl.arange(0, R)
        th_hi, th_lo = _theta_split(tl.load(th_ptr + r))
        a = _rope_angle(tl.load(p_ptr + i).to(tl.float32)[:, None], th_hi[None, :], th_lo[None, :])
        c, s = _rope_cos_sin(a, DOT)  # the approximate cosine and sine on a GPU
        tl.store(a_ptr + i[:, None] * R + r[None, :], a)
        tl.store(c_ptr + i[:, None] * R + r[None, :], c)
        tl.store(s_ptr + i[:, None] * R + r[None, :], s)


@needs_triton
def test_rope_angle_reduction_at_long_positions():
    """The kernels' angle reduction (``_rope_angle``) for positions up to 131071 and all 64
    realistic θ of d = 128: reduced to ``[-π, π]`` (where ``cos.approx.f32`` holds its accuracy:
    the unreduced ``p·θ_lo`` part reached ~1e3 rad), cos/sin (:func:`_rope_cos_sin`: approximate on a
    GPU) within 2e-4 of float64 (a float32 ``p·θ`` is off by up to 4e-3 rad there)."""
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0, 1, 4095, 4096, 65535, 65536, 131071])
    pos = torch.cat([edges, torch.randint(0, 131072, (57,), generator=gen)])
    th = inv_freq(128).float()
    a = torch.empty(64, 64, device=DEVICE)
    c = torch.empty(64, 64, device=DEVICE)
    s = torch.empty(64, 64, device=DEVICE)
    _angles_kernel[(1,)](pos.int().to(DEVICE), th.to(DEVICE), a, c, s, N=64, R=64, DOT=dot_dtype())
    assert a.abs().max() <= math.pi + 1e-3
    exact = pos.double()[:, None] * th.double()[None, :]
    assert (c.cpu().double() - exact.cos()).abs().max() < 2e-4
    assert (s.cpu().double() - exact.sin()).abs().max() < 2e-4
    naive = (pos.float()[:, None] * th[None, :]).double()  # the plain float32 product
    assert (naive.cos() - exact.cos()).abs().max() > 1e-3


@needs_triton
@pytest.mark.parametrize("t0", [0, 64, 100032])
@pytest.mark.parametrize(("r", "p"), [(16, 16), (8, 8), (3, 8)])
def test_rope_score_term_is_float32_exact_on_tensor_cores(t0, r, p):
    """``_rope_scores`` (the extend and ``tl`` decode kernels' term, added to the score tile it is
    given) against float64, to 3e-5 of the term's scale: its product is three bf16 dots of
    two-term splits (``hi·hi + hi·lo + lo·hi``, ~2^-17); one bf16 product alone, or a split that
    keeps no remainder, is off by ~2^-9. ``R`` pairs in ``P`` slots: cosines and sines share one
    ``K = 2P`` operand, and the slots past ``R`` (zero coefficients, as the hosts pad them) add
    nothing."""
    gen = torch.Generator().manual_seed(t0 + r)
    m, n = 16, 64
    rc = torch.zeros(m, 2, p)
    rc[:, :, :r] = torch.randn(m, 2, r, generator=gen) * 10
    th = torch.zeros(p)
    th[:r] = inv_freq(2 * r).float()
    acc = torch.randn(m, n, generator=gen)
    out = torch.empty(m, n, device=DEVICE)
    _rope_term_kernel[(1,)](
        rc.to(DEVICE), th.to(DEVICE), acc.to(DEVICE), out, t0, M=m, R=r, P=p, N=n, DOT=dot_dtype()
    )
    ang = (t0 + torch.arange(n)).double()[None, :] * th[:r].double()[:, None]  # [R, N]
    want = acc.double() + rc[:, 0, :r].double() @ ang.cos() + rc[:, 1, :r].double() @ ang.sin()
    scale = (rc.double().abs().sum((1, 2))).max()
    # ~2^-17 of the scale from the split products, 2.7e-6 at 100k from the angle reduction's
    # rounding; one bf16 product alone: ~2^-9
    assert (out.cpu().double() - want).abs().max() < 3e-5 * scale


def test_op_carries_the_rope_mean():
    """``torch.ops.oscar.decode_attention`` takes the pre-RoPE mean's tensors: same output as the
    direct call, and different from dropping them."""
    from oscar_kernels.ops import decode_attention_op

    d = 64 if DEVICE.type == "cuda" else 32
    gen = torch.Generator().manual_seed(11)
    lo = CacheLayout(2, d, page_size=8, sink_tokens=3, recent_tokens=5)
    lens = [2, 13, 21]
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, "kv_head")
    ep = with_rope(params, 2, d, 2, gen).expand(2, d, cache.device)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 4, d, generator=gen).bfloat16().to(DEVICE)
    out = decode_attention_op(q, cache, ep, bt, sl, ws)
    assert torch.equal(out, decode_attention(q, cache, ep, bt, sl, ws))
    assert rel(out, decode_attention_op(q, cache, without_term(ep), bt, sl, ws)) > 1e-2
