"""``R_V`` folded into the output projection: ``ExpandedParams.rotated_output`` leaves every path's
output in the rotated basis, and the folded weight turns it into the unfolded model's output."""

from dataclasses import replace

import pytest
import torch
from conftest import DEVICE, extend_batch, fill_cache, needs_triton

from oscar_kernels import (
    CacheLayout,
    decode_attention,
    dense_attention_ref,
    extend_attention,
    extend_attention_ref,
    fold_output_rotation,
)
from oscar_math import OscarError


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _rotate_back(o: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``[..., H_q, d]`` rotated outputs → ``o @ R_Vᵀ`` per KV head (float64)."""
    *lead, hq, d = o.shape
    h = rot.shape[0]
    x = o.double().reshape(*lead, h, hq // h, d)
    return torch.einsum("...hgd,hed->...hge", x, rot.double().cpu().to(o.device)).reshape(o.shape)


@pytest.mark.parametrize("hkv, g", [(2, 4), (1, 3), (4, 1)])
def test_folded_weight_reads_the_rotated_outputs_as_the_model_reads_its_own(hkv, g):
    """``y = Σ_h (o_rot,h R_Vᵀ) W_hᵀ = Σ_h o_rot,h (W_h R_V)ᵀ``: per-KV-head rotations, GQA 1-4,
    float32 weights (to 1e-5) and bf16 ones (one rounding of the weight)."""
    gen = torch.Generator().manual_seed(hkv * 10 + g)
    d, hq, out = 16, hkv * g, 24
    rot = torch.linalg.qr(torch.randn(hkv, d, d, generator=gen, dtype=torch.float64))[0].float()
    o_rot = torch.randn(5, hq, d, generator=gen)
    w = torch.randn(out, hq * d, generator=gen)
    want = _rotate_back(o_rot, rot).reshape(5, -1) @ w.double().t()
    folded = w.clone()
    fold_output_rotation(folded, rot, hq)
    got = o_rot.reshape(5, -1).double() @ folded.double().t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    wb = w.bfloat16()
    fold_output_rotation(wb, rot, hq)
    assert wb.dtype == torch.bfloat16
    assert rel(o_rot.reshape(5, -1).double() @ wb.double().t(), want) < 1e-2
    # one rotation for every head (per-layer granularity) is the same as it repeated per head
    one, many = w.clone(), w.clone()
    fold_output_rotation(one, rot[0], hq)
    fold_output_rotation(many, rot[:1].expand(hkv, d, d), hq)
    torch.testing.assert_close(one, many, rtol=0, atol=0)


def test_fold_refuses_mismatched_shapes():
    w = torch.zeros(8, 4 * 16)
    rot = torch.eye(16).expand(2, 16, 16)
    with pytest.raises(OscarError, match="output projection input size"):
        fold_output_rotation(w, rot, 6)
    with pytest.raises(OscarError, match="query heads"):
        fold_output_rotation(torch.zeros(8, 3 * 16), rot, 3)
    with pytest.raises(OscarError, match="floating-point"):
        fold_output_rotation(w.int(), rot, 4)


def _case(seed: int = 3, d: int = 64):
    gen = torch.Generator().manual_seed(seed)
    h, g = 2, 2
    lo = CacheLayout(h, d, page_size=16, sink_tokens=4, recent_tokens=10)
    lens, chunks = [7, 45, 70], [7, 1, 33]
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, "kv_head", pending=chunks)
    ep = params.expand(h, d, cache.device)
    q, k, v, cu, prefix = extend_batch(lens, chunks, keys, values, h * g, gen)
    return (q, k, v, cache, ep, cu, prefix, bt, ws, max(chunks)), lens


@pytest.mark.parametrize(
    "path",
    ["extend-ref", pytest.param("extend-triton", marks=needs_triton),
     pytest.param("extend-split", marks=needs_triton), pytest.param("extend-dense", marks=needs_triton)],
)  # fmt: skip
def test_extend_paths_leave_rotated_outputs(path):
    """Every prefill path (reference, Triton extend unsplit and split, the dense path's one-pass
    merge) returns ``o_rot`` in the query dtype where ``rotated_output``: un-rotated, the model's
    output (within bf16 rounding), and not the same as the unfolded output (the flag works)."""
    args, _ = _case()
    ep = args[4]
    folded = replace(ep, rotated_output=True)

    def run(p):
        a = (*args[:4], p, *args[5:])
        if path == "extend-ref":
            return extend_attention_ref(*a)
        if path == "extend-dense":
            return extend_attention(*a, backend="triton", dense=dense_attention_ref, dense_min_query=2)
        kw = {"num_splits": 3} if path == "extend-split" else {}
        return extend_attention(*a, backend="triton", block_m=16, block_n=16, **kw)

    plain, rotated = run(ep), run(folded)
    assert rotated.dtype == plain.dtype == torch.bfloat16
    assert rel(_rotate_back(rotated, ep.v_rotation), plain) < 1e-2
    assert rel(rotated, plain) > 0.1


@pytest.mark.parametrize(
    "backend, impl",
    [("torch", "tl"), pytest.param("triton", "tl", marks=needs_triton),
     pytest.param("triton", "gluon", marks=needs_triton)],
)  # fmt: skip
def test_decode_leaves_rotated_outputs(backend, impl):
    """The decode op (reference; Triton's split kernel + ``merge_cols_kernel``; the Gluon kernel)
    returns ``o_rot`` in the query dtype where ``rotated_output``, into a caller's buffer too."""
    from oscar_kernels.decode_attention import gluon_unavailable_reason

    args, lens = _case(5, d=128 if impl == "gluon" else 64)  # the Gluon kernel needs d % 128 == 0
    cache, ep, bt, ws = args[3], args[4], args[7], args[8]
    if impl == "gluon" and (why := gluon_unavailable_reason(cache)) is not None:
        pytest.skip(f"Gluon kernel cannot run here: {why}")
    q = args[0][: len(lens)].contiguous()
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    kw = {"backend": backend}
    if backend == "triton":
        kw.update(num_splits=3, block_n=16 if impl == "tl" else 32, impl=impl)
    plain = decode_attention(q, cache, ep, bt, sl, ws, **kw)
    rotated = decode_attention(q, cache, replace(ep, rotated_output=True), bt, sl, ws, **kw)
    assert rotated.dtype == torch.bfloat16
    assert rel(_rotate_back(rotated, ep.v_rotation), plain) < 1e-2
    assert rel(rotated, plain) > 0.1
    buf = torch.empty_like(rotated)
    decode_attention(q, cache, replace(ep, rotated_output=True), bt, sl, ws, out=buf, **kw)
    torch.testing.assert_close(buf, rotated, rtol=0, atol=0)
