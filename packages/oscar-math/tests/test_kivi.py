import pytest
import torch

from oscar_math import OscarError, fake_quantize_int2, kivi_fake_quantize_keys, kivi_fake_quantize_values


def _ref_keys(k, tg):
    # brute force: each (block, head, channel) column quantised over its tokens
    out = torch.empty_like(k)
    t, h, d = k.shape
    for s in range(0, t, tg):
        blk = k[s : s + tg]  # [b, H, d]
        for hh in range(h):
            for c in range(d):
                col = blk[:, hh, c]
                mn, mx = col.min(), col.max()
                zero = mn.to(torch.bfloat16).float()
                scale = ((mx - mn) / 3).to(torch.bfloat16).float()
                inv = 1.0 / scale if scale > 0 else torch.tensor(0.0)
                code = torch.floor((col - zero) * inv + 0.5).clamp(0, 3)
                out[s : s + tg, hh, c] = code * scale + zero
    return out


@pytest.mark.parametrize("t,tg", [(37, 8), (64, 32), (5, 32), (29, 6)])
def test_keys_match_brute_force_per_channel_blocks(t, tg):
    g = torch.Generator().manual_seed(t * 100 + tg)
    k = torch.randn(t, 2, 12, generator=g) * torch.linspace(0.1, 5, 12)
    got = kivi_fake_quantize_keys(k, tg)
    ref = _ref_keys(k, tg)
    assert got.shape == k.shape
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


def test_keys_isolate_an_outlier_channel_better_than_per_token():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(256, 1, 64, generator=g)
    k[..., 3] = k[..., 3] * 30 + 50  # a channel outlier, as in real keys
    err_kivi = (kivi_fake_quantize_keys(k, 32) - k).pow(2).mean()
    err_token = (fake_quantize_int2(k, 64) - k).pow(2).mean()
    assert err_kivi < 0.5 * err_token


def test_values_are_per_token_reference():
    v = torch.randn(9, 3, 64)
    assert torch.equal(kivi_fake_quantize_values(v), fake_quantize_int2(v, 64))
    assert torch.equal(kivi_fake_quantize_values(v, 32), fake_quantize_int2(v, 32))


def test_bf16_input_keeps_dtype():
    k = torch.randn(10, 2, 16).to(torch.bfloat16)
    assert kivi_fake_quantize_keys(k, 4).dtype == torch.bfloat16


def test_bad_shape_names_argument():
    with pytest.raises(OscarError, match="k.shape"):
        kivi_fake_quantize_keys(torch.randn(4, 16), 4)
