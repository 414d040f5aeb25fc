"""The BF16-pages baseline kernel against its torch reference (random pages, scattered tables)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, compile_check_ptx, needs_triton

from oscar_kernels import paged_bf16_decode
from oscar_math import OscarError


def _case(h: int, g: int, d: int, page: int, lens: list[int], seed: int):
    gen = torch.Generator().manual_seed(seed)
    per = max(-(-n // page) for n in lens) + 1
    n_pages = len(lens) * per + 3
    k = torch.randn(n_pages, h, page, d, generator=gen).bfloat16().to(DEVICE)
    v = torch.randn(n_pages, h, page, d, generator=gen).bfloat16().to(DEVICE)
    # every sequence's pages scattered over the pool
    table = torch.randperm(n_pages, generator=gen)[: len(lens) * per].view(len(lens), per)
    q = torch.randn(len(lens), h * g, d, generator=gen).bfloat16().to(DEVICE)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    return q, k, v, table.to(torch.int32).to(DEVICE), sl


@needs_triton
@pytest.mark.parametrize(
    "h, g, d, page, splits, block_n",
    [
        (2, 4, 64, 16, 1, 16),
        (1, 3, 64, 8, 3, 16),  # GQA 3 (padded rows), tiles of two pages
        (3, 1, 64, 16, 5, 32),  # more splits than some sequences have tiles
        (2, 2, 128, 16, None, 64),  # the default split count, tiles of four pages
    ],
)
def test_baseline_matches_reference(h, g, d, page, splits, block_n):
    # empty, one token, page boundaries, odd lengths
    lens = [0, 1, page - 1, page, page + 1, 37, 3 * page + 5]
    q, k, v, table, sl = _case(h, g, d, page, lens, seed=h * 100 + g * 10 + page)
    out = paged_bf16_decode(q, k, v, table, sl, num_splits=splits, block_n=block_n, backend="triton")
    ref = paged_bf16_decode(q, k, v, table, sl, backend="torch")
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert out[0].abs().max() == 0  # empty sequence
    tol = 2e-2 if HAS_CUDA else 1e-4  # bf16 tl.dot operands on a GPU, float32 in the interpreter
    for b in range(1, len(lens)):
        err = (out[b] - ref[b]).norm() / ref[b].norm()
        assert err < tol, (b, lens[b], float(err))


def test_baseline_input_errors():
    q, k, v, table, sl = _case(2, 2, 64, 16, [5, 9], seed=1)
    with pytest.raises(OscarError, match="shape of v_pages"):
        paged_bf16_decode(q, k, v[:, :1], table, sl)
    with pytest.raises(OscarError, match="shape of q"):
        paged_bf16_decode(q[:, :3], k, v, table, sl)
    with pytest.raises(OscarError, match="seq_lens"):
        paged_bf16_decode(q, k, v, table, sl[:1])
    with pytest.raises(OscarError, match="backend"):
        paged_bf16_decode(q, k, v, table, sl, backend="cuda")


@needs_triton
def test_baseline_kernel_compiles_for_sm90():
    """The GPU path the interpreter never lowers compiles for sm_90 offline, with tensor-core dots."""
    ptx = compile_check_ptx("cc.compile_bf16_baseline(90)")
    assert "mma.sync" in ptx or "wgmma" in ptx
