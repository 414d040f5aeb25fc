"""Benchmark baseline: decode attention over plain BF16 pages (kernel and torch reference).

``paged_bf16_decode`` runs :mod:`oscar_kernels.kernels.bf16_decode` (the INT2 decode kernel's tile
loop over 16-bit rows) and the INT2 op's merge, so INT2 vs BF16 timings compare one kernel design.
The kernel benchmarks (``benchmarks/gpu_run.py``) and oscar-calib's BF16 paged loop use it; no
engine serves with it.
"""

from __future__ import annotations

import math

import torch

from oscar_math import check

from ._validate import check_index_tensor
from .decode_attention import choose_num_splits, merge_partials, pdl_available
from .launch import launch

__all__ = ["paged_bf16_decode"]


def _check(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, block_table, seq_lens) -> None:
    check(k_pages.dim() == 4, "rank of k_pages", 4, k_pages.dim())
    check(tuple(v_pages.shape) == tuple(k_pages.shape), "shape of v_pages", tuple(k_pages.shape),
          tuple(v_pages.shape))  # fmt: skip
    _, h, _, d = k_pages.shape
    check(q.dim() == 3 and q.shape[2] == d and q.shape[1] % h == 0, "shape of q",
          f"[B, a multiple of {h}, {d}]", tuple(q.shape))  # fmt: skip
    check_index_tensor("seq_lens", seq_lens, (q.shape[0],), k_pages.device)
    check(block_table.dim() == 2, "rank of block_table", 2, block_table.dim())
    check_index_tensor("block_table", block_table, (q.shape[0], block_table.shape[1]), k_pages.device)


def _reference(q, k_pages, v_pages, block_table, seq_lens, scale):  # noqa: ANN001, ANN202
    """Float32 softmax attention over each sequence's gathered pages (zeros for an empty one)."""
    _, h, ps, d = k_pages.shape
    g = q.shape[1] // h
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pages = block_table[b, : -(-n // ps)].long()
        k = k_pages[pages].transpose(0, 1).reshape(h, -1, d)[:, :n].float().repeat_interleave(g, 0)
        v = v_pages[pages].transpose(0, 1).reshape(h, -1, d)[:, :n].float().repeat_interleave(g, 0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[b].float(), k) * scale, dim=-1)
        out[b] = torch.einsum("hn,hnd->hd", p, v)
    return out


def paged_bf16_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    backend: str = "auto",
) -> torch.Tensor:
    """Split-K decode attention over plain BF16 pages (no rotation, no windows).

    Args:
        q: ``[B, H_q, d]`` bf16 (``H_q`` a multiple of ``H_kv``).
        k_pages, v_pages: ``[num_pages, H_kv, page_size, d]`` bf16.
        block_table: ``[B, max_pages]`` int32; seq_lens: ``[B]`` int32.
        num_splits: splits per (sequence, KV head); default :func:`choose_num_splits`.
        block_n, num_warps, num_stages: tile size and launch options.
        backend: ``auto`` | ``triton`` | ``torch`` (the reference: float32 softmax attention over
            each sequence's gathered pages).
    Returns:
        ``[B, H_q, d]`` float32.
    """
    from ._backend import dot_dtype, interpreting, use_triton

    _check(q, k_pages, v_pages, block_table, seq_lens)
    _, h, ps, d = k_pages.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    if not use_triton(k_pages.device, backend):
        return _reference(q, k_pages, v_pages, block_table, seq_lens, scale)
    import triton

    from .kernels.bf16_decode import bf16_decode_split_kernel

    bsz, hq = q.shape[0], q.shape[1]
    g = hq // h
    if num_splits is None:
        num_splits = choose_num_splits(bsz, h, block_table.shape[1] * ps, q.device, block_n)
    if q.stride(2) != 1:
        q = q.contiguous()
    po = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
    plse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    opts = {} if interpreting() else {"num_warps": num_warps, "num_stages": num_stages}
    launch(bf16_decode_split_kernel, (bsz * h, num_splits),
        q, q.stride(0), q.stride(1), k_pages, v_pages, *k_pages.stride()[:3], block_table,
        block_table.stride(0), seq_lens, po, plse, scale * math.log2(math.e), ps,
        H_KV=h, GQA=g, G_PAD=max(16, triton.next_power_of_2(g)), HEAD_DIM=d, NUM_SPLITS=num_splits,
        BLOCK_N=block_n, DOT=dot_dtype(), **opts,
    )  # fmt: skip
    return merge_partials(po, plse, g, pdl=pdl_available(q.device))
