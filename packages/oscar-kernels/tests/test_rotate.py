"""The rotations around the attention kernels (``oscar_kernels.rotate``): the Triton tile kernel
against the float64 product and the torch reference, on random rows, odd row counts around the
64-row tile, shared (stride-0) and transposed rotations, a key mean, strided inputs and bf16
rounding; the two-set merge fused with the output's un-rotation (``merge_unrotate``) against the
float64 merge and its torch form, with empty key sets in either or both sets."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import DEVICE, compile_check_ptx, make_params, needs_triton

from oscar_kernels import rotate_chunk, rotate_queries, unrotate_output
from oscar_kernels.rotate import _rotate, merge_two_ref, merge_unrotate


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


def _partials(t: int, hq: int, d: int, gen: torch.Generator):  # noqa: ANN202
    """Two partial outputs (bf16, strided rows) and their log-sum-exps ``[H_q, T]``: one a
    transposed ``[T, H_q]`` view, with the empty-set markers FlashAttention and others use (+inf,
    -inf, NaN), rows where one set dominates by far, and rows where both sets are empty."""
    o1 = torch.randn(t, hq, d + 8, generator=gen).bfloat16().to(DEVICE)[..., 5 : 5 + d]
    o2 = torch.randn(t, hq, d, generator=gen).bfloat16().to(DEVICE)
    l1 = 3 * torch.randn(hq, t, generator=gen)
    l2 = 3 * torch.randn(t, hq, generator=gen).t()  # a transposed view: strides (1, H_q)
    l1[0, ::5] = float("inf")
    l1[-1, 1::7] = float("-inf")
    l2[:, 2::6] = float("inf")
    l2[1 % hq, 3::9] = float("nan")
    l2[:, ::11] = float("-inf")
    l1[:, ::11] = float("inf")  # both sets empty on these rows
    l1[:, 4::13] = 90.0  # one set outweighs the other by e^90
    return o1, l1.to(DEVICE), o2, l2.to(DEVICE)


def _merge_f64(o1, l1, o2, l2):  # noqa: ANN001, ANN202 - float64 truth of the two-set merge
    l1, l2 = l1.double().t()[..., None], l2.double().t()[..., None]
    ok1, ok2 = torch.isfinite(l1), torch.isfinite(l2)
    m = torch.maximum(torch.where(ok1, l1, -torch.inf), torch.where(ok2, l2, -torch.inf))
    m = torch.where(torch.isfinite(m), m, 0.0)
    w1 = torch.where(ok1, torch.exp(torch.where(ok1, l1, 0.0) - m), 0.0)
    w2 = torch.where(ok2, torch.exp(torch.where(ok2, l2, 0.0) - m), 0.0)
    den = torch.where(w1 + w2 > 0, w1 + w2, 1.0)
    return (o1.double() * w1 + o2.double() * w2) / den


@needs_triton
@pytest.mark.parametrize("t", [1, 37, 64, 130])
@pytest.mark.parametrize(("h", "g", "d"), [(2, 1, 64), (2, 4, 128), (3, 2, 32)])
def test_merge_unrotate_matches_float64(t, h, g, d):
    """The fused merge + un-rotation (Triton) against the float64 merge times ``R_Vᵀ``; a row
    whose sets are both empty is 0; one set (``o2 = None``) is that set's output un-rotated."""
    gen = torch.Generator().manual_seed(t * 13 + d)
    ep = make_params(h, d, "kv_head", gen).expand(h, d, DEVICE)
    o1, l1, o2, l2 = _partials(t, h * g, d, gen)
    rot = ep.v_rotation.double().transpose(-1, -2)

    def unrot(x):  # noqa: ANN001, ANN202
        y = torch.einsum("nhgd,hde->nhge", x.reshape(t, h, g, d), rot)
        return y.reshape(t, h * g, d)

    got = merge_unrotate(o1, l1, o2, l2, ep, torch.float32, backend="triton")
    want = unrot(_merge_f64(o1, l1, o2, l2))
    assert got.shape == (t, h * g, d) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() < 2e-5
    empty = ~(torch.isfinite(l1) | torch.isfinite(l2)).t()  # [T, H_q]
    assert empty.any() and (got[empty] == 0).all()
    one = merge_unrotate(o1, l1, None, None, ep, torch.float32, backend="triton")
    want_one = unrot(torch.where(torch.isfinite(l1).t()[..., None], o1.double(), 0.0))
    assert (one.double() - want_one).abs().max() < 2e-5
    # R_V folded into the engine's output projection: the merge alone, in the output dtype
    kept = replace(ep, rotated_output=True)
    merged = merge_unrotate(o1, l1, o2, l2, kept, torch.bfloat16, backend="triton")
    assert merged.dtype == torch.bfloat16
    assert (merged.double() - _merge_f64(o1, l1, o2, l2)).abs().max() < 2e-2
    torch.testing.assert_close(merged, merge_unrotate(o1, l1, o2, l2, kept, torch.bfloat16, backend="torch"))


@needs_triton
def test_merge_unrotate_agrees_with_its_torch_form_in_bf16():
    """The Triton launch and the torch form (``merge_two_ref`` then ``unrotate_output``) round
    to the same bf16 but for values next to a rounding boundary (one bf16 step of the row)."""
    gen = torch.Generator().manual_seed(5)
    h, g, d, t = 4, 4, 128, 150
    ep = make_params(h, d, "kv_head", gen).expand(h, d, DEVICE)
    o1, l1, o2, l2 = _partials(t, h * g, d, gen)
    got = merge_unrotate(o1, l1, o2, l2, ep, torch.bfloat16, backend="triton")
    ref = merge_unrotate(o1, l1, o2, l2, ep, torch.bfloat16, backend="torch")
    two_steps = unrotate_output(merge_two_ref(o1, l1, o2, l2), ep, torch.bfloat16, backend="torch")
    assert torch.equal(ref, two_steps)
    assert got.dtype == ref.dtype == torch.bfloat16
    amax = ref.float().abs().amax(-1, keepdim=True)
    step = torch.exp2(torch.floor(torch.log2(amax.clamp_min(1e-30))) - 7)  # one bf16 ulp at the row's max
    assert ((got.float() - ref.float()).abs() <= step).all()
    assert (got != ref).float().mean() < 0.01


@needs_triton
@pytest.mark.parametrize("two", [True, False])
def test_merge_unrotate_compiles_for_sm90(two):
    """The fused merge's GPU path compiles for sm_90 offline (the interpreter never lowers it),
    its un-rotation on tensor cores."""
    ptx = compile_check_ptx(f"cc.compile_merge_unrotate(90, two={two})")
    assert "mma" in ptx and "ex2.approx" in ptx
