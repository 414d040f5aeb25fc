"""Triton body of the dense path's near rows (:func:`oscar_kernels.extend_dense._near_rows`):
the BF16 keys (or values) a chunk's queries read within the recent window, one row per
``(sequence, position)`` — the chunk's own rotated row, else the prefix's sink or ring row.

One launch per tensor instead of three gathers and two selects over the whole set in torch
(the H200 profile of a 32k prompt, 2026-12-04: ~0.4 ms a layer of index and select kernels per
16k-token step). Pure copies: bitwise equal to the torch form, rows past a segment included.
"""

import triton
import triton.language as tl


# bounds only: one compile for every size; the per-row and per-sequence index tensors may be
# views at a step's row offset (any address): one compile for every offset
@triton.jit(
    do_not_specialize=["n_rows", "n_tok", "ring"],
    do_not_specialize_on_alignment=["seq_ptr", "pos_ptr", "pre_ptr", "start_ptr", "ws_ptr"],
)
def near_rows_kernel(
    seq_ptr, pos_ptr, pre_ptr, start_ptr, ws_ptr,
    chunk_ptr, stride_cn, stride_ch,
    ring_ptr, stride_rs, stride_rh, stride_rt,
    sink_ptr, stride_ss, stride_sh, stride_st,
    out_ptr, stride_on, stride_oh,
    n_rows, n_tok, ring,
    D: tl.constexpr, D_P2: tl.constexpr, SINK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``(m, h)``: rows ``m·BLOCK + [0, BLOCK)`` of KV head ``h``. Row ``r`` is position
    ``p = pos[r]`` of sequence ``b = seq[r]``: for ``p >= pre[b]`` the chunk's row
    ``clamp(start[b] + p - pre[b], 0, n_tok - 1)``, else the sink row ``p`` of window slot
    ``ws[b]`` (``p < SINK``) or its ring row ``p % ring``."""
    h = tl.program_id(1)
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = r < n_rows
    b = tl.load(seq_ptr + r, mask=live, other=0).to(tl.int64)
    p = tl.load(pos_ptr + r, mask=live, other=0).to(tl.int64)
    pre = tl.load(pre_ptr + b, mask=live, other=0).to(tl.int64)
    mine = live & (p >= pre)
    old = live & (p < pre)
    tok = tl.load(start_ptr + b, mask=live, other=0).to(tl.int64) + (p - pre)
    tok = tl.minimum(tl.maximum(tok, 0), n_tok - 1)
    ws = tl.load(ws_ptr + b, mask=old, other=0).to(tl.int64)
    d = tl.arange(0, D_P2)
    dm = (d < D)[None, :]
    x = tl.load(chunk_ptr + (tok * stride_cn + h * stride_ch)[:, None] + d[None, :], mask=mine[:, None] & dm)
    if SINK > 0:
        in_sink = p < SINK
        srow = ws * stride_ss + h * stride_sh + tl.minimum(p, SINK - 1) * stride_st
        y = tl.load(sink_ptr + srow[:, None] + d[None, :], mask=(old & in_sink)[:, None] & dm)
        rrow = ws * stride_rs + h * stride_rh + (p % ring) * stride_rt
        z = tl.load(ring_ptr + rrow[:, None] + d[None, :], mask=(old & ~in_sink)[:, None] & dm)
        y = tl.where(in_sink[:, None], y, z)
    else:
        rrow = ws * stride_rs + h * stride_rh + (p % ring) * stride_rt
        y = tl.load(ring_ptr + rrow[:, None] + d[None, :], mask=old[:, None] & dm)
    out = tl.where(mine[:, None], x, y.to(x.dtype))
    orow = r.to(tl.int64) * stride_on + h * stride_oh
    tl.store(out_ptr + orow[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None] & dm)
