"""Write + attention end to end against an oracle in the ORIGINAL (un-rotated) basis.

The oracle never touches kernel code: it quantises the raw keys/values with
``oscar_math``'s reference quantiser (after centring and rotating them with the test's
own matrices), un-rotates the dequantised rows (``x_hat @ Rᵀ``, plus the key mean), and
attends with the *un-rotated* queries in float64. Tokens inside the BF16 windows are
the bf16-rounded rotated rows, un-rotated the same way. A wrong query rotation
(``R_Kᵀ`` for ``R_K``), a wrong window boundary or a wrong output un-rotation changes
the answer by tens of percent; what is left is bf16 rounding of the rotated query and
of the kernel's operands (~0.5 %).

The Triton write runs in ``precise`` (full fp32) mode here: its default tf32 rotation moves
~0.2 % of codes by one step against the float64 reference (test_paged_write bounds that),
which on these 30-token sequences is 3-10 % of an output (seen on the H200) and would hide
the attention kernels' own error. This file checks attention; the write's rounding is
checked where it is written.

Errors are checked per sequence (and per query in extend), never averaged over a batch.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE, fill_cache, needs_triton

from oscar_kernels import CacheLayout, decode_attention, extend_attention
from oscar_math import dequantize_int2, quantize_int2

SINK, RECENT = 3, 6
# bf16 query rotation and bf16 operands vs float64: measured <= 0.42 % here (CPU); the bugs this
# guards against give 20-140 %
TOL = 2e-2


def effective_kv_original(k, v, ep, lo, window_end, int2=True):
    """``[n, H, d]`` float64 keys/values attention must see, in the original basis.

    Positions ``j < sink`` and ``j >= max(sink, window_end - recent)`` are the bf16 rotated
    rows; the rest are dequantised INT2 (``int2=False``: every row bf16). ``window_end - 1`` is
    the query's position: extend and decode apply the windows per query token.
    """
    k64, v64 = k.double().cpu(), v.double().cpu()
    mean = ep.k_mean.double().cpu()
    rk, rv = ep.k_rotation.double().cpu(), ep.v_rotation.double().cpu()
    kr = torch.einsum("nhd,hde->nhe", k64 - mean, rk).float()
    vr = torch.einsum("nhd,hde->nhe", v64, rv).float()
    kq = dequantize_int2(quantize_int2(kr, lo.group, ep.k_clip.cpu()[:, None])).double()
    vq = dequantize_int2(quantize_int2(vr, lo.group, ep.v_clip.cpu()[:, None])).double()
    j = torch.arange(k.shape[0])
    win = (j < lo.sink_tokens) | (j >= max(lo.sink_tokens, window_end - lo.recent_tokens))
    if not int2:
        win[:] = True
    kq[win] = kr[win].bfloat16().double()
    vq[win] = vr[win].bfloat16().double()
    k_orig = torch.einsum("nhe,hde->nhd", kq, rk) + mean
    v_orig = torch.einsum("nhe,hde->nhd", vq, rv)
    return k_orig, v_orig


def attend(q, k, v, mask=None):
    """``q [m, H_q, d]`` over ``k/v [n, H_kv, d]`` in float64 (GQA by repeat)."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("mhd,nhd->hmn", q.double(), k.repeat_interleave(g, 1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", torch.softmax(s, -1), v.repeat_interleave(g, 1))


def rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm())


# Head dim: 32 keeps the interpreter quick on CPU; a GPU needs d/4 >= 16 for tl.dot.
D = 64 if DEVICE.type == "cuda" else 32

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "granularity, group, fill",
    [("kv_head", None, {"cuts": []}), ("layer", 16, {"steps": 3}), ("kv_head", 8, {"cuts": [SINK, 11]})],
    ids=["kv_head-prefill", "layer-g16-steps", "kv_head-g8-chunks"],
)
def test_decode_matches_original_basis_oracle(backend, granularity, group, fill):
    gen = torch.Generator().manual_seed(21)
    lo = CacheLayout(2, D, page_size=4, group_size=group, sink_tokens=SINK, recent_tokens=RECENT)
    # < sink, = sink + recent, one over, and INT2 middles of several lengths
    lens = [2, SINK + RECENT, SINK + RECENT + 1, 17, 30]
    cache, params, bt, ws, keys, values = fill_cache(
        lo, lens, gen, granularity, backend=backend, precise=True, **fill
    )
    ep = params.expand(2, D, cache.device)
    q = torch.randn(len(lens), 6, D, generator=gen).bfloat16().to(DEVICE)  # GQA 3
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = {"num_splits": 2, "block_n": 16} if backend == "triton" else {}
    out = decode_attention(q, cache, params, bt, sl, ws, backend=backend, **kw)
    for b, n in enumerate(lens):
        k, v = effective_kv_original(keys[b], values[b], ep, lo, n)
        want = attend(q[b : b + 1].cpu(), k, v)[0]
        assert rel(out[b], want) < TOL, (b, n, rel(out[b], want))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
def test_extend_matches_original_basis_oracle(backend, granularity):
    gen = torch.Generator().manual_seed(22)
    lo = CacheLayout(2, D, page_size=4, group_size=16, sink_tokens=SINK, recent_tokens=RECENT)
    lens = [5, 12, 20, 27, 14]
    # a first chunk, decode-like, chunk inside the window, chunk > recent, a first chunk > sink + recent
    chunks = [5, 1, 4, 11, 14]
    prefix = [n - c for n, c in zip(lens, chunks, strict=True)]
    # the chunks' INT2 + sink rows written before attention, their ring rows after (not here)
    cache, params, bt, ws, keys, values = fill_cache(
        lo, lens, gen, granularity, backend=backend, precise=True, pending=chunks
    )
    ep = params.expand(2, D, cache.device)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(chunks), 4, D, generator=gen).bfloat16().to(DEVICE)  # GQA 2
    k = torch.cat([keys[b][p:] for b, p in enumerate(prefix)])
    v = torch.cat([values[b][p:] for b, p in enumerate(prefix)])
    pl = torch.tensor(prefix, dtype=torch.int32, device=DEVICE)
    kw = {"block_m": 16, "block_n": 16} if backend == "triton" else {}
    out = extend_attention(q, k, v, cache, params, cu, pl, bt, ws, max(chunks), backend=backend, **kw)
    for b, (n, c) in enumerate(zip(lens, chunks, strict=True)):
        s0 = int(cu[b])
        for i in range(c):  # every query of every sequence on its own, with its own window
            t = n - c + i
            kk, vv = effective_kv_original(keys[b][: t + 1], values[b][: t + 1], ep, lo, t + 1)
            want = attend(q[s0 + i : s0 + i + 1].cpu(), kk, vv)[0]
            e = rel(out[s0 + i], want)
            assert e < TOL, (b, i, e)
