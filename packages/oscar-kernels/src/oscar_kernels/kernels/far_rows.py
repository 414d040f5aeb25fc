"""Triton body of the dense path's far rows (:func:`oscar_kernels.extend_dense._far_rows`): the
INT2 rows of a prefix dequantised to bf16 in the rotated basis, the pre-RoPE mean's rotated
``RoPE_p(m) @ R_K`` added back to key rows, the BF16 sink rows in place of their INT2 copies.

One launch per tensor (K, V) replaces about fifteen torch ops per row block (gathers of codes,
scales and zeros, the unpack, a float32 GEMM for the RoPE term, the sink select, the cast); the
H200 profile of a 32k prompt's 8k-token steps put ~90 ms a step in such glue (2026-12-04).

Exactness against the torch form: ``code · scale + zero`` in float32 without FMA fusion, the sink
rows copied, bf16 rounded to nearest even by hand (the interpreter truncates) — bitwise equal to
the torch form for value rows and for key rows without a pre-RoPE mean. With one, the RoPE term's
cosines and sines are float32 polynomials (``paged_write``'s ``_cos_sin``) and its product a
3×TF32 ``tl.dot``, against float64 angles and a float32 GEMM in the torch form: a few float32
ulps before the bf16 rounding. Each row's result depends on that row only (fixed tiles), so a
prefix-cache hit's far rows equal the miss's.
"""

import triton
import triton.language as tl

from .paged_write import _cos_sin, round_bf16


# bounds only: one compile for every size; the per-row index tensors are views at a step's row
# offset (any address): one compile for every offset (they are gathered, never vector-loaded)
@triton.jit(
    do_not_specialize=["n_rows", "last_page"],
    do_not_specialize_on_alignment=["seq_ptr", "pos_ptr", "table_ptr", "ws_ptr"],
)
def far_rows_kernel(
    seq_ptr, pos_ptr, table_ptr, stride_tb, ws_ptr,
    codes_ptr, stride_cp, stride_ch, stride_ct,
    scale_ptr, zero_ptr, stride_sp, stride_sh, stride_st,
    sink_ptr, stride_ks, stride_kh, stride_kt,
    rmean_ptr, stride_rmh, freq_ptr, rot_ptr, stride_rh, stride_rr,
    out_ptr, stride_on, stride_oh,
    n_rows, page_size, last_page,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, SINK: tl.constexpr, HAS_ROPE: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``(m, h)``: rows ``m·BLOCK + [0, BLOCK)`` of KV head ``h``. Row ``r`` is position
    ``pos[r]`` of sequence ``seq[r]``: its page is ``table[seq, min(pos // page_size, last_page)]``
    (rows past a sequence's end read some page; they are never attended). Quarter ``i`` of a row
    is bit pair ``i`` of its ``d/4`` code bytes (the strided packing), columns ``i·d/4 + j``."""
    h = tl.program_id(1)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = r < n_rows
    s = tl.load(seq_ptr + r, mask=live, other=0).to(tl.int64)
    p = tl.load(pos_ptr + r, mask=live, other=0)
    col = tl.minimum(p // page_size, last_page)
    page = tl.load(table_ptr + s * stride_tb + col, mask=live, other=0).to(tl.int64)
    off = (p % page_size).to(tl.int64)
    Q4: tl.constexpr = HEAD_DIM // 4
    HALF: tl.constexpr = HEAD_DIM // 2
    j = tl.arange(0, Q4)
    byte = tl.load(
        codes_ptr + (page * stride_cp + h * stride_ch + off * stride_ct)[:, None] + j[None, :],
        mask=live[:, None],
        other=0,
    ).to(tl.int32)
    mrow = page * stride_sp + h * stride_sh + off * stride_st
    if HAS_ROPE:
        # RoPE_p(m) as its two halves (pair i: coordinates i and i + d/2), as paged_write centres
        i = tl.arange(0, HALF)
        a = tl.load(rmean_ptr + h * stride_rmh + i).to(tl.float32)[None, :]
        b = tl.load(rmean_ptr + h * stride_rmh + HALF + i).to(tl.float32)[None, :]
        cos, sin = _cos_sin(p.to(tl.float32)[:, None] * tl.load(freq_ptr + i).to(tl.float32)[None, :])
        rlo = a * cos - b * sin
        rhi = b * cos + a * sin
        rbase = rot_ptr + h * stride_rh + i[:, None] * stride_rr + j[None, :]
    if SINK > 0:
        in_sink = live & (p < SINK)
        ws = tl.load(ws_ptr + s, mask=in_sink, other=0).to(tl.int64)
        srow = ws * stride_ks + h * stride_kh + tl.where(in_sink, p, 0).to(tl.int64) * stride_kt
    orow = r.to(tl.int64) * stride_on + h * stride_oh
    for qi in tl.static_range(4):
        c = ((byte >> (2 * qi)) & 3).to(tl.float32)
        grp = (qi * Q4 + j) // GROUP
        sc = tl.load(scale_ptr + mrow[:, None] + grp[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        zr = tl.load(zero_ptr + mrow[:, None] + grp[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        x = c * sc + zr
        if HAS_ROPE:
            t = tl.dot(rlo, tl.load(rbase + qi * Q4).to(tl.float32), input_precision="tf32x3")
            t = tl.dot(rhi, tl.load(rbase + HALF * stride_rr + qi * Q4).to(tl.float32), acc=t,
                       input_precision="tf32x3")  # fmt: skip
            x = x + t
        if SINK > 0:
            sv = tl.load(sink_ptr + srow[:, None] + (qi * Q4 + j)[None, :], mask=in_sink[:, None], other=0.0)
            x = tl.where(in_sink[:, None], sv.to(tl.float32), x)
        y = round_bf16(x).to(tl.bfloat16)
        tl.store(out_ptr + orow[:, None] + (qi * Q4 + j)[None, :], y, mask=live[:, None])
