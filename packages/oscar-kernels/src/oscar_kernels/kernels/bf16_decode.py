"""Benchmark baseline kernel: split-K decode over plain BF16 pages (no rotation, no windows).

The tile loop of :func:`oscar_kernels.kernels.attention.decode_split_kernel` with 16-bit key and
value rows where that kernel reads INT2 codes, and the same merge kernel after it, so the ratio of
the two measures what the INT2 format costs or saves in one kernel design. Not used when serving.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention import _bf16_tile, _decode_program, _init_state, _load_q, _store_partial


@triton.jit
def bf16_decode_split_kernel(
    q_ptr, stride_qb, stride_qh, k_ptr, v_ptr, stride_cp, stride_ch, stride_ct, bt_ptr, stride_bt,
    seqlen_ptr, po_ptr, plse_ptr, sm_scale_log2, page_size,
    H_KV: tl.constexpr, GQA: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Program ``(b*H_kv + h, split)``: all ``GQA`` query heads of KV head ``h`` over split
    ``split`` of ``[0, seq_len)`` (equal ``BLOCK_N``-aligned shares); pages ``[P, H_kv, page, d]``.
    Writes the normalised partial and its log2-sum-exp to ``po [B, H_q, NUM_SPLITS, d]`` /
    ``plse`` (an empty split: ``-inf``)."""
    b, h, split, rmask, hq = _decode_program(H_KV, GQA, G_PAD)
    Q4: tl.constexpr = HEAD_DIM // 4
    length = tl.load(seqlen_ptr + b)
    q0, q1, q2, q3, _ = _load_q(q_ptr, b * stride_qb + hq * stride_qh, rmask, Q4, DOT)
    m_i, l_i, acc0, acc1, acc2, acc3 = _init_state(G_PAD, Q4)
    per = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per
    hi = tl.minimum(length, lo + per)
    for t0 in range(lo, hi, BLOCK_N):
        tok = t0 + tl.arange(0, BLOCK_N)
        tmask = tok < hi
        page = tl.load(bt_ptr + b * stride_bt + tok // page_size, mask=tmask, other=0).to(tl.int64)
        row = page * stride_cp + h * stride_ch + (tok % page_size) * stride_ct
        m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_tile(
            q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3, k_ptr, v_ptr, row, tmask, sm_scale_log2, Q4, DOT
        )
    prow = (b * (H_KV * GQA) + hq) * NUM_SPLITS + split
    _store_partial(po_ptr, plse_ptr, prow, rmask, m_i, l_i, acc0, acc1, acc2, acc3, HEAD_DIM)
