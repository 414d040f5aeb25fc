"""Radix-hit window rebuild with a pre-RoPE key mean (artifact format version 3), no SGLang needed.

``rebuild_windows`` turns INT2 rows back into BF16 window rows; with a pre-RoPE mean an INT2 key
row's value includes ``RoPE_j(m) @ R_K``, so a rebuild without it would hand attention keys off by
the mean (silently wrong numbers after every radix hit).
"""

from __future__ import annotations

import torch

from oscar_kernels import CacheLayout, LayerQuantParams, allocate_cache
from oscar_math.rope_center import rope_position_mean
from oscar_sglang.core import rebuild_windows


def _cache_and_params(seed: int = 0):
    h, d, page = 2, 16, 4
    lo = CacheLayout(
        num_kv_heads=h, head_dim=d, page_size=page, group_size=16, sink_tokens=2, recent_tokens=4
    )
    cache = allocate_cache(lo, num_pages=6, max_seqs=2)
    g = torch.Generator().manual_seed(seed)
    cache.k_codes.copy_(
        torch.randint(0, 256, cache.k_codes.shape, generator=g, dtype=torch.int32).to(cache.k_codes.dtype)
    )
    cache.v_codes.copy_(
        torch.randint(0, 256, cache.v_codes.shape, generator=g, dtype=torch.int32).to(cache.v_codes.dtype)
    )
    for t in (cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero):
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
    mean = torch.zeros(h, d)
    mean[:, [1, 5, 1 + d // 2, 5 + d // 2]] = 3.0 * torch.randn(h, 4, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    rope = LayerQuantParams(rot, rot, k_rope_mean=mean, k_rope_inv_freq=inv_freq).expand(h, d, cache.device)
    plain = LayerQuantParams(rot, rot).expand(h, d, cache.device)
    return cache, rope, plain


def test_rebuilt_window_keys_carry_the_position_mean_and_values_do_not():
    cache, rope, plain = _cache_and_params()
    table = torch.tensor([3, 0, 5, 1], dtype=torch.int32)
    prefix = 14  # sink rows 0-1, ring rows 10-13 (pages 0, 1, 2, 3 of the table)
    rebuild_windows(cache, table, 0, 0, prefix, params=plain)
    k0 = (
        cache.k_sink[0].clone(),
        cache.k_recent[0].clone(),
        cache.v_sink[0].clone(),
        cache.v_recent[0].clone(),
    )
    rebuild_windows(cache, table, 1, 0, prefix, params=rope)
    k1 = (cache.k_sink[1], cache.k_recent[1], cache.v_sink[1], cache.v_recent[1])
    j = torch.tensor([0, 1, 10, 11, 12, 13])
    mu = torch.einsum(
        "nhd,hde->nhe", rope_position_mean(rope.k_rope_mean, j, rope.k_rope_inv_freq), rope.k_rotation
    )
    lo = cache.layout
    for n, pos in enumerate(j.tolist()):
        got = k1[0][:, pos] if pos < lo.sink_tokens else k1[1][:, pos % lo.recent_tokens]
        base = k0[0][:, pos] if pos < lo.sink_tokens else k0[1][:, pos % lo.recent_tokens]
        # the rebuilt key is the INT2 row plus RoPE_j(m) @ R_K (one bf16 rounding each)
        torch.testing.assert_close(got.float(), (base.float() + mu[n]), rtol=0.02, atol=0.05)
        assert float((got.float() - base.float()).abs().max()) > 0.1  # the term is really there
    assert torch.equal(k1[2], k0[2]) and torch.equal(k1[3], k0[3])  # values: unchanged
