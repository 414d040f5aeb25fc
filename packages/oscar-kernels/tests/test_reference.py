"""The torch references against an oracle built from raw keys/values (no cache layout)."""

import math

import conftest
import pytest
import torch
from conftest import fill_cache

from oscar_kernels import CacheLayout, decode_attention_ref, extend_attention_ref, rotate_queries
from oscar_math import dequantize_int2, quantize_int2


@pytest.fixture(autouse=True)
def _on_cpu(monkeypatch):
    """The references are checked against the float64 oracle on CPU (the oracle and these
    tests build their tensors there); on a GPU the Triton tests compare against them."""
    monkeypatch.setattr(conftest, "DEVICE", torch.device("cpu"))


def effective_kv(k, v, ep, lo, window_end):
    """What attention must read: BF16 rotated rows inside the windows, INT2 elsewhere (f64)."""
    kr = torch.einsum("nhd,hde->nhe", k.float() - ep.k_mean, ep.k_rotation)
    vr = torch.einsum("nhd,hde->nhe", v.float(), ep.v_rotation)
    kq = dequantize_int2(quantize_int2(kr, lo.group, ep.k_clip[:, None])).double()
    vq = dequantize_int2(quantize_int2(vr, lo.group, ep.v_clip[:, None])).double()
    j = torch.arange(k.shape[0])
    win = (j < lo.sink_tokens) | (j >= max(lo.sink_tokens, window_end - lo.recent_tokens))
    kq[win] = kr[win].bfloat16().double()
    vq[win] = vr[win].bfloat16().double()
    return kq, vq


def attend64(q, k, v, ep, mask=None):
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("mhd,nhd->hmn", q, k.repeat_interleave(g, 1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    o = torch.einsum("hmn,nhd->mhd", torch.softmax(s, -1), v.repeat_interleave(g, 1))
    h = ep.v_rotation.shape[0]
    m, hq, d = o.shape
    return (o.reshape(m, h, hq // h, d) @ ep.v_rotation.double().transpose(-1, -2)).reshape(o.shape)


@pytest.mark.parametrize("granularity", ["layer", "kv_head"])
@pytest.mark.parametrize("group", [None, 16])
def test_decode_ref_matches_raw_oracle(granularity, group):
    gen = torch.Generator().manual_seed(1)
    lo = CacheLayout(2, 32, page_size=8, group_size=group, sink_tokens=4, recent_tokens=6)
    lens = [0, 3, 4, 10, 11, 17, 40]  # empty, < sink, = sink + recent, +1, page boundaries
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, granularity, steps=3)
    ep = params.expand(2, 32, cache.device)
    q = torch.randn(len(lens), 6, 32, generator=gen).bfloat16()
    out = decode_attention_ref(q, cache, ep, bt, torch.tensor(lens).int(), ws)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    qr = rotate_queries(q, ep).double()
    assert out[0].abs().max() == 0
    for b, n in enumerate(lens[1:], 1):
        kq, vq = effective_kv(keys[b], values[b], ep, lo, n)
        want = attend64(qr[b : b + 1], kq, vq, ep)[0]
        err = (out[b].double() - want).norm() / want.norm()
        assert err < 1e-2, (b, n, err)


def test_extend_ref_matches_raw_oracle():
    """Per query token: key j of query t is INT2 iff sink <= j <= t - recent, wherever j is."""
    gen = torch.Generator().manual_seed(2)
    lo = CacheLayout(2, 32, page_size=8, sink_tokens=4, recent_tokens=6)
    lens = [5, 12, 30, 29]
    chunks = [5, 3, 9, 20]  # a whole first chunk, chunks over cached prefixes, one > recent
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, pending=chunks)
    ep = params.expand(2, 32, cache.device)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    prefix = torch.tensor([n - c for n, c in zip(lens, chunks, strict=True)], dtype=torch.int32)
    q = torch.randn(sum(chunks), 4, 32, generator=gen).bfloat16()
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([values[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    out = extend_attention_ref(q, k, v, cache, ep, cu, prefix, bt, ws, max(chunks))
    qr = rotate_queries(q, ep).double()
    for b, (n, c) in enumerate(zip(lens, chunks, strict=True)):
        s0 = int(cu[b])
        for i in range(c):  # every query on its own: its own window
            t = n - c + i
            kq, vq = effective_kv(keys[b][: t + 1], values[b][: t + 1], ep, lo, t + 1)
            want = attend64(qr[s0 + i : s0 + i + 1], kq, vq, ep)[0]
            err = (out[s0 + i].double() - want).norm() / want.norm()
            assert err < 1e-2, (b, i, err)
