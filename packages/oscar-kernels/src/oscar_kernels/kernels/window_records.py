"""Triton body of :func:`oscar_kernels.window_records.write_window_records`: one program per
(token, K/V, head) copies the token's ring row and its record's sink-part rows into the pages."""

import triton
import triton.language as tl


# the tables' group stride is B·W, B the step's rows, and NT the step's tokens: not specialised, one
# compile for every batch
@triton.jit(do_not_specialize=["tab_sg", "NT"])
def window_records_kernel(
    rows_ptr, rows_s0, rows_s1,
    tab_ptr, tab_sg, tab_sb,
    slot_map_ptr, sidx_ptr, pos_ptr, wslot_ptr, rring_ptr,
    rk_ptr, rv_ptr, r_s0, r_s1, r_s2,
    sk_ptr, sv_ptr, s_s0, s_s1, s_s2,
    RPP, RING, WB, PARTS, NT,
    H: tl.constexpr, SINK: tl.constexpr, PART: tl.constexpr, PART_P2: tl.constexpr,
    D: tl.constexpr, D_P2: tl.constexpr, SINK_IN_RING: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    kv = tl.program_id(1) // H
    h = tl.program_id(1) % H
    d = tl.arange(0, D_P2)
    zd = d * 0  # masks are built as vectors (the interpreter refuses scalar masks)
    live = tl.load(slot_map_ptr + t + zd) >= 0  # padding tokens write nothing
    is_k = (zd + kv) == 0  # K and V rows come from two tensors: load both masked, keep one (bitwise)
    is_v = (zd + kv) == 1
    dm = (d < D) & live
    # a padding token reads position 0 of its row (its own position may lie past the table)
    live_i = (tl.load(slot_map_ptr + t) >= 0).to(tl.int64)
    b = tl.load(sidx_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64) * live_i
    wslot = tl.load(wslot_ptr + b).to(tl.int64)
    src_row = tl.load(rring_ptr + b).to(tl.int64)
    blk = pos // WB
    # the ring row: from the ring, or from the sink rows for positions < sink
    r = (kv * H + h) * WB + pos % WB
    page = tl.load(tab_ptr + (r // RPP) * tab_sg + b * tab_sb + blk).to(tl.int64)
    ring_off = src_row * r_s0 + h * r_s1 + (pos % RING) * r_s2 + d
    vals = tl.where(
        is_k,
        tl.load(rk_ptr + ring_off, mask=dm & is_k, other=0.0),
        tl.load(rv_ptr + ring_off, mask=dm & is_v, other=0.0),
    )
    if SINK_IN_RING:
        in_sink = (zd + pos) < SINK
        sink_off = wslot * s_s0 + h * s_s1 + tl.minimum(pos, SINK - 1) * s_s2 + d
        sv = tl.where(
            is_k,
            tl.load(sk_ptr + sink_off, mask=dm & in_sink & is_k, other=0.0),
            tl.load(sv_ptr + sink_off, mask=dm & in_sink & is_v, other=0.0),
        )
        vals = tl.where(in_sink, sv, vals)
    tl.store(rows_ptr + page * rows_s0 + (r % RPP) * rows_s1 + d, vals.to(rows_ptr.dtype.element_ty), mask=dm)
    if PART > 0:
        # the sink part is the same rows for every token of the block: only the last token of the
        # step's run in this (row, block) writes it (its next token, if any, is padding, another
        # row's or another block's), not all of them (a 16k-token prefill at block 64, sink part
        # 16 wrote 17 rows per token instead of 1 + 16 / 64)
        tn = tl.minimum(t + 1, NT - 1)
        run_goes_on = (
            (t + 1 < NT)
            & (tl.load(slot_map_ptr + tn) >= 0)
            & (tl.load(sidx_ptr + tn).to(tl.int64) == b)
            & (tl.load(pos_ptr + tn).to(tl.int64) // WB == blk)
        )
        j = tl.arange(0, PART_P2)
        s = (blk % PARTS) * PART + j
        ok = (j < PART) & (s < SINK) & (tl.load(slot_map_ptr + t + j * 0) >= 0) & ((j * 0 + run_goes_on) == 0)
        rs = 2 * H * WB + (kv * H + h) * PART + j
        pg = tl.load(tab_ptr + (rs // RPP) * tab_sg + b * tab_sb + blk, mask=ok, other=0).to(tl.int64)
        off = wslot * s_s0 + h * s_s1 + tl.minimum(s, SINK - 1)[:, None] * s_s2 + d[None, :]
        m2 = ok[:, None] & (d < D)[None, :]
        k2 = ((j * 0 + kv) == 0)[:, None] & m2
        v2 = ((j * 0 + kv) == 1)[:, None] & m2
        x = tl.where(k2, tl.load(sk_ptr + off, mask=k2, other=0.0), tl.load(sv_ptr + off, mask=v2, other=0.0))
        dst = rows_ptr + pg[:, None] * rows_s0 + (rs % RPP)[:, None] * rows_s1 + d[None, :]
        tl.store(dst, x.to(rows_ptr.dtype.element_ty), mask=m2)
