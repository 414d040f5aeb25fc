"""The rotations around the attention kernels (``oscar_kernels.rotate``): the Triton tile kernel
against the float64 product and the torch reference, on random rows, odd row counts around the
64-row tile, shared (stride-0) and transposed rotations, a key mean, strided inputs and bf16
rounding."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, make_params, needs_triton

from oscar_kernels import rotate_chunk, rotate_queries, unrotate_output
from oscar_kernels.rotate import _rotate


def _want(x, rot, mean=None):  # noqa: ANN001, ANN202 - float64 truth
    xd = x.double() if mean is None else x.double() - mean.double().unsqueeze(-2)
    return torch.einsum("nhgd,hde->nhge", xd, rot.double())


def _orth(h: int, d: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))[0].float().to(DEVICE)


@needs_triton
@pytest.mark.parametrize("rows", [1, 63, 64, 65, 130])
@pytest.mark.parametrize(("h", "g", "d"), [(2, 1, 64), (3, 3, 32), (2, 4, 128)])
def test_triton_rotation_matches_float64(rows, h, g, d):
    gen = torch.Generator().manual_seed(rows * 7 + d)
    big = torch.randn(rows, h, g, d + 8, generator=gen).to(DEVICE)
    x = big[..., 3 : 3 + d]  # strided rows: the kernel reads the view, no copy
    rot = _orth(h, d, gen)
    mean = torch.randn(h, d, generator=gen).to(DEVICE)
    for kw in ({}, {"mean": mean}):
        got = _rotate(x, rot, torch.float32, backend="triton", **kw)
        want = _want(x, rot, kw.get("mean"))
        assert got.shape == x.shape
        assert (got.double() - want).abs().max() < 2e-5, kw.keys()
    # x @ rotᵀ through a transposed view, and one rotation shared by every head (stride 0)
    got = _rotate(x, rot.transpose(-1, -2), torch.float32, backend="triton")
    assert (got.double() - _want(x, rot.transpose(-1, -2))).abs().max() < 2e-5
    shared = rot[:1].expand(h, d, d)
    got = _rotate(x, shared, torch.float32, backend="triton")
    assert (got.double() - _want(x, shared)).abs().max() < 2e-5


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_rotation_rounds_to_nearest_even(dtype):
    """The low-precision output is the float32 product rounded to nearest (even), as torch's
    ``.to(dtype)`` rounds it: what the kernels downstream and the reference both read."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(97, 2, 4, 64, generator=gen).to(DEVICE)
    rot = _orth(2, 64, gen)
    f32 = _rotate(x, rot, torch.float32, backend="triton")
    low = _rotate(x, rot, dtype, backend="triton")
    assert low.dtype == dtype
    assert torch.equal(low, f32.to(dtype))


@needs_triton
def test_triton_and_torch_rotations_agree_to_one_bf16_step():
    """Float32-accurate products in another order: the bf16 results differ by at most one bf16
    step of the row's scale (a product next to a rounding boundary; where a sum cancels to near
    zero, one step of the row, not of the tiny value), and almost always not at all."""
    gen = torch.Generator().manual_seed(11)
    h, d = 4, 128
    ep = make_params(h, d, "kv_head", gen).expand(h, d, DEVICE)
    q = torch.randn(77, 3 * h, d, generator=gen).to(DEVICE).bfloat16()
    k = torch.randn(77, h, d, generator=gen).to(DEVICE).bfloat16()
    o = torch.randn(77, 3 * h, d, generator=gen).to(DEVICE)
    pairs = []
    for b in ("triton", "torch"):
        pairs.append(
            (
                rotate_queries(q, ep, backend=b),
                *rotate_chunk(k, k, ep, backend=b),
                unrotate_output(o, ep, q.dtype, backend=b),
            )
        )
    for got, ref in zip(*pairs, strict=True):
        assert got.shape == ref.shape and got.dtype == ref.dtype
        step = ref.float().abs().amax(-1, keepdim=True) * 2.0**-8
        assert ((got.float() - ref.float()).abs() <= step).all()
        assert (got != ref).float().mean() < 0.01


def test_unsupported_head_dims_use_the_torch_form():
    """A head dim the tile kernel does not take (not a power of two) still rotates, in torch."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 2, 1, 80, generator=gen).to(DEVICE)
    rot = _orth(2, 80, gen)
    got = _rotate(x, rot, torch.float32)
    assert (got.double() - _want(x, rot)).abs().max() < 2e-5
