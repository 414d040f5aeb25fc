"""Mixed-precision attention against a brute-force per-query loop."""

from __future__ import annotations

import pytest
import torch

from oscar_calib.simulate import (
    LayerErrors,
    Windows,
    exact_attention,
    mixed_attention,
    quantized_region,
)


def _brute(q, k, v, kh, vh, scaling, sink, recent):
    """One query at a time: build that query's K/V exactly as the serving cache would."""
    b, hq, t, d = q.shape
    s = k.shape[2]
    g = hq // k.shape[1]
    out = torch.zeros(b, t, hq, d, dtype=torch.float64)
    for i in range(t):
        pos = s - t + i
        for h in range(hq):
            kv = h // g
            keys, vals = [], []
            for j in range(pos + 1):
                quant = sink <= j <= pos - recent
                keys.append((kh if quant else k)[:, kv, j])
                vals.append((vh if quant else v)[:, kv, j])
            kk, vv = torch.stack(keys, 1).double(), torch.stack(vals, 1).double()
            w = torch.softmax(torch.einsum("bd,bsd->bs", q[:, h, i].double(), kk) * scaling, -1)
            out[:, i, h] = torch.einsum("bs,bsd->bd", w, vv)
    return out


@pytest.mark.parametrize("t,s,sink,recent,block", [(23, 23, 3, 5, 7), (5, 29, 2, 4, 3), (17, 17, 0, 1, 64)])
def test_mixed_attention_matches_brute_force(t, s, sink, recent, block):
    g = torch.Generator().manual_seed(t * 100 + s)
    b, hq, hkv, d = 2, 6, 2, 8
    q = torch.randn(b, hq, t, d, generator=g)
    k, v = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    kh, vh = k + 0.3 * torch.randn_like(k), v + 0.3 * torch.randn_like(v)
    ref = _brute(q, k, v, kh, vh, 0.35, sink, recent)
    fused = mixed_attention(q, k, v, kh, vh, 0.35, Windows(sink, recent))
    torch.testing.assert_close(fused.double(), ref, atol=1e-5, rtol=1e-5)
    fused = mixed_attention(q, k, v, kh, vh, 0.35, Windows(sink, recent), block=block)  # row blocks
    torch.testing.assert_close(fused.double(), ref, atol=1e-5, rtol=1e-5)
    errs = LayerErrors()  # capturing errors takes the blocked path
    blocked = mixed_attention(q, k, v, kh, vh, 0.35, Windows(sink, recent), block=block, errors=errs)
    torch.testing.assert_close(blocked.double(), ref, atol=1e-5, rtol=1e-5)


def test_mixed_equals_exact_when_hat_is_exact():
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(1, 4, 31, 16, generator=g),
        torch.randn(1, 2, 31, 16, generator=g),
        torch.randn(1, 2, 31, 16, generator=g),
    )
    errs = LayerErrors()
    out = mixed_attention(q, k, v, k, v, 0.25, Windows(2, 3), block=8, errors=errs)
    torch.testing.assert_close(out, exact_attention(q, k, v, 0.25), atol=1e-5, rtol=1e-5)
    assert errs.logit_err == 0 and errs.out_err < 1e-10 and errs.logit_ref > 0 and errs.rows > 0


def test_error_capture_is_relative_and_ignores_per_query_offsets():
    g = torch.Generator().manual_seed(2)
    q, k, v = (
        torch.randn(1, 2, 40, 8, generator=g),
        torch.randn(1, 1, 40, 8, generator=g),
        torch.randn(1, 1, 40, 8, generator=g),
    )
    # a constant key shift changes every logit of a query by q·c: no logit error, no output error
    errs = LayerErrors()
    mixed_attention(q, k, v, k + 0.7, v, 1.0, Windows(0, 1), errors=errs)
    assert errs.logit_rel < 1e-5
    noisy = LayerErrors()
    mixed_attention(q, k, v, k + 0.5 * torch.randn_like(k), v + 0.5, 1.0, Windows(4, 8), errors=noisy)
    assert 0.05 < noisy.logit_rel < 2 and noisy.output_rel > 0.01


def test_quantized_region_window_edges():
    m = quantized_region(torch.arange(10), torch.arange(10), sink=2, recent=3)
    assert m[9].tolist() == [False, False, True, True, True, True, True, False, False, False]
    assert not m[:5].any() and m[5].tolist()[2] and not m[5].tolist()[3]


def test_strided_error_capture_keeps_output_and_estimates_errors():
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 4, 64, 8, generator=g),
        torch.randn(1, 2, 64, 8, generator=g),
        torch.randn(1, 2, 64, 8, generator=g),
    )
    kh, vh = k + 0.3 * torch.randn_like(k), v + 0.3 * torch.randn_like(v)
    full, strided = LayerErrors(), LayerErrors()
    ref = mixed_attention(q, k, v, kh, vh, 0.3, Windows(2, 6), block=16, errors=full)
    out = mixed_attention(q, k, v, kh, vh, 0.3, Windows(2, 6), block=16, errors=strided, error_row_stride=4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert 0 < strided.rows < full.rows
    assert abs(strided.logit_rel - full.logit_rel) < 0.25 * full.logit_rel


@pytest.mark.parametrize("t,s,chunk,additive", [(29, 29, 4, False), (9, 30, 1, True), (26, 26, 5, True)])
def test_fused_row_blocks_match_the_materialised_path(t, s, chunk, additive):
    # The fused path (SDPA per block of query rows, keys cut at the block's causal end and at
    # the last key it reads quantised) against the materialised logits of the error path,
    # with chunked windows and a user mask; blocks of 4 rows split chunks and windows.
    g = torch.Generator().manual_seed(t + s + chunk)
    q = torch.randn(1, 4, t, 8, generator=g)
    k, v = torch.randn(1, 2, s, 8, generator=g), torch.randn(1, 2, s, 8, generator=g)
    kh, vh = k + 0.4 * torch.randn_like(k), v + 0.4 * torch.randn_like(v)
    mask = torch.ones(1, 1, t, s, dtype=torch.bool)
    mask[..., 5] = False  # a quantisable key hidden by the caller
    mask[..., 1, 0] = False
    user = torch.zeros(1, 1, t, s).masked_fill(~mask, float("-inf")) if additive else mask
    w = Windows(3, 5, chunk)
    ref = mixed_attention(q, k, v, kh, vh, 0.3, w, user, block=4, errors=LayerErrors())
    out = mixed_attention(q, k, v, kh, vh, 0.3, w, user, block=4)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, mixed_attention(q, k, v, k, v, 0.3, w, user, block=4), atol=1e-3)
