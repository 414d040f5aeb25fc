"""Triton body of :func:`oscar_kernels.window_records.write_window_records`: one program per
(tile of ``TOK`` tokens, K/V, head) copies the tokens' ring rows and, for a token that ends its run
in a window block, the block's sink-part rows into the pages.

A program per token (and K/V, head) made a 16k-token chunk 262k programs of one 256-byte row each:
0.75 ms a layer on the H100 where the bytes take ~40 µs. A tile of tokens is one ``[TOK, D]`` load
and store."""

import triton
import triton.language as tl


@triton.jit
def _kv_load(k_ptr, v_ptr, off, mask, kv):
    """``k_ptr[off]`` or ``v_ptr[off]`` (masked, 0 elsewhere) as the program's ``kv`` says: one load
    behind a uniform branch (two masked loads and a select cost a program twice the instructions)."""
    if kv == 0:
        x = tl.load(k_ptr + off, mask=mask, other=0.0)
    else:
        x = tl.load(v_ptr + off, mask=mask, other=0.0)
    return x


# the tables' group stride is B·W, B the step's rows, and NT the step's tokens: not specialised, one
# compile for every batch. The record geometry (RPP, RING, WB, PARTS) is an engine's constant and a
# compile-time one: its divisions and remainders become shifts or multiplies (as run-time int64
# operands they were 57 emulated 64-bit div/rem instructions in the sm_90 PTX of one program)
@triton.jit(do_not_specialize=["tab_sg", "NT"])
def window_records_kernel(
    rows_ptr, rows_s0, rows_s1,
    tab_ptr, tab_sg, tab_sb,
    slot_map_ptr, sidx_ptr, pos_ptr, wslot_ptr, rring_ptr,
    rk_ptr, rv_ptr, r_s0, r_s1, r_s2,
    sk_ptr, sv_ptr, s_s0, s_s1, s_s2,
    NT, RPP: tl.constexpr, RING: tl.constexpr, WB: tl.constexpr, PARTS: tl.constexpr,
    H: tl.constexpr, SINK: tl.constexpr, PART: tl.constexpr, PART_P2: tl.constexpr,
    D: tl.constexpr, D_P2: tl.constexpr, SINK_IN_RING: tl.constexpr, TOK: tl.constexpr,
    TC: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * TOK + tl.arange(0, TOK)
    kv = tl.program_id(1) // H
    h = tl.program_id(1) % H
    d = tl.arange(0, D_P2)
    in_step = t < NT
    live = (tl.load(slot_map_ptr + t, mask=in_step, other=-1) >= 0) & in_step  # padding writes nothing
    dm = live[:, None] & (d < D)[None, :]
    # a padding token reads position 0 of its row (its own position may lie past the table)
    b = tl.load(sidx_ptr + t, mask=in_step, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + t, mask=in_step, other=0).to(tl.int64) * live.to(tl.int64)
    wslot = tl.load(wslot_ptr + b).to(tl.int64)
    src_row = tl.load(rring_ptr + b).to(tl.int64)
    blk = pos // WB
    # the ring row: from the ring, or from the sink rows for positions < sink
    r = (kv * H + h) * WB + pos % WB
    page = tl.load(tab_ptr + (r // RPP) * tab_sg + b * tab_sb + blk).to(tl.int64)
    ring_off = (src_row * r_s0 + h * r_s1 + (pos % RING) * r_s2)[:, None] + d[None, :]
    vals = _kv_load(rk_ptr, rv_ptr, ring_off, dm, kv)
    if SINK_IN_RING:
        in_sink = pos < SINK
        sink_off = (wslot * s_s0 + h * s_s1 + tl.minimum(pos, SINK - 1) * s_s2)[:, None] + d[None, :]
        ms = dm & in_sink[:, None]
        sv = _kv_load(sk_ptr, sv_ptr, sink_off, ms, kv)
        vals = tl.where(in_sink[:, None], sv, vals)
    dst = rows_ptr + (page * rows_s0 + (r % RPP) * rows_s1)[:, None] + d[None, :]
    tl.store(dst, vals.to(rows_ptr.dtype.element_ty), mask=dm)
    if PART > 0:
        # the sink part is the same rows for every token of the block: only the last token of the
        # step's run in this (row, block) writes it (its next token, if any, is padding, another
        # row's or another block's), not all of them (at block 64, sink part 16, every token wrote
        # 17 rows instead of 1 + 16 / 64). A [TC * PART_P2, D] tile per TC tokens, the chunks
        # unrolled: a loop of TOK scalar passes chained ~5 dependent loads per token (13 µs a
        # decode layer on the H100 for one token) where independent chunks overlap theirs.
        e = tl.arange(0, TC * PART_P2)
        j = e % PART_P2
        rs = 2 * H * WB + (kv * H + h) * PART + j
        for c in tl.static_range(0, TOK, TC):
            ti = tl.program_id(0) * TOK + c + e // PART_P2
            tn = tl.minimum(ti + 1, NT - 1)
            ti_c = tl.minimum(ti, NT - 1)
            bi = tl.load(sidx_ptr + ti_c).to(tl.int64)
            pi = tl.load(pos_ptr + ti_c).to(tl.int64)
            run_goes_on = (
                (ti + 1 < NT)
                & (tl.load(slot_map_ptr + tn) >= 0)
                & (tl.load(sidx_ptr + tn).to(tl.int64) == bi)
                & (tl.load(pos_ptr + tn).to(tl.int64) // WB == pi // WB)
            )
            ends = (ti < NT) & (tl.load(slot_map_ptr + ti_c) >= 0) & (run_goes_on == 0)
            bk = pi // WB
            s = (bk % PARTS) * PART + j
            ok = (j < PART) & (s < SINK) & ends
            ws = tl.load(wslot_ptr + bi).to(tl.int64)
            pg = tl.load(tab_ptr + (rs // RPP) * tab_sg + bi * tab_sb + bk, mask=ok, other=0).to(tl.int64)
            off = (ws * s_s0 + h * s_s1 + tl.minimum(s, SINK - 1) * s_s2)[:, None] + d[None, :]
            m2 = ok[:, None] & (d < D)[None, :]
            x = _kv_load(sk_ptr, sv_ptr, off, m2, kv)
            dst2 = rows_ptr + (pg * rows_s0 + (rs % RPP) * rows_s1)[:, None] + d[None, :]
            tl.store(dst2, x.to(rows_ptr.dtype.element_ty), mask=m2)
