import pytest
import torch
from conftest import fill_cache, needs_triton

from oscar_kernels import CacheLayout
from oscar_math import quantize_int2, unpack_int2

FIELDS = (
    "k_codes",
    "v_codes",
    "k_scale",
    "k_zero",
    "v_scale",
    "v_zero",
    "k_sink",
    "v_sink",
    "k_recent",
    "v_recent",
)


def test_reference_write_matches_quantize_int2():
    gen = torch.Generator().manual_seed(3)
    lo = CacheLayout(2, 32, page_size=8, group_size=16, sink_tokens=3, recent_tokens=5)
    cache, params, bt, ws, keys, values = fill_cache(lo, [21], gen, "kv_head")
    ep = params.expand(2, 32, cache.device)
    kr = torch.einsum("nhd,hde->nhe", keys[0].float() - ep.k_mean, ep.k_rotation)
    q = quantize_int2(kr, 16, ep.k_clip[:, None])
    p = torch.arange(21)
    pg, off = bt[0].long()[p // 8], p % 8
    assert torch.equal(cache.k_codes[pg, :, off], q.codes)
    assert torch.equal(cache.k_scale[pg, :, off], q.scale)
    # sink holds positions 0..2, the ring the last 5 at row p % 5
    assert torch.equal(cache.k_sink[ws[0], :, :3].transpose(0, 1), kr[:3].bfloat16())
    rows = torch.arange(16, 21) % 5
    assert torch.equal(cache.k_recent[ws[0], :, rows].transpose(0, 1), kr[16:].bfloat16())


@needs_triton
@pytest.mark.parametrize(
    "d, h, page, group, sink, recent, granularity",
    [
        (64, 2, 16, None, 5, 12, "layer"),
        (64, 3, 8, 32, 4, 6, "kv_head"),
        (128, 1, 16, 64, 0, 9, "layer"),
        (32, 2, 4, 8, 2, 0, "kv_head"),
    ],
)
def test_triton_write_matches_reference(d, h, page, group, sink, recent, granularity):
    gen = torch.Generator().manual_seed(d + h)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=recent)
    lens = [1, sink + recent, sink + recent + 1, 37]
    state = gen.get_state()
    a = fill_cache(lo, lens, gen, granularity, backend="triton", steps=2)[0]
    gen.set_state(state)
    b = fill_cache(lo, lens, gen, granularity, backend="torch", steps=2)[0]
    # the kernel's fp32 (tf32 on GPU) rotation sums in another order than torch's: rotated
    # values may differ in the last bit, so a rare code flips by one step at a rounding tie
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        if x.numel() == 0:
            continue
        if f.endswith("codes"):
            diff = unpack_int2(x).int() - unpack_int2(y).int()
            assert (diff != 0).float().mean() <= 5e-3 and diff.abs().max() <= 1, f
        else:
            xf, yf = x.float(), y.float()
            close = (xf - yf).abs() <= 2**-7 * yf.abs() + 1e-6
            # tf32 rotation on a GPU: 98.2 % of window values within 2^-7 (H200, 2026-11-30)
            want = 0.97 if torch.cuda.is_available() else 0.99
            assert close.float().mean() >= want and torch.equal(xf == 0, yf == 0), f
