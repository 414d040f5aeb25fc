"""Fused write: rotate, centre, clip, min/max, quantise, pack, store (+ BF16 windows)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_bf16(x):
    """float32 → the nearest bf16 value (ties to even), still as float32.

    Done with integer ops so the result is identical on GPU and under the
    interpreter (whose float32 → bf16 cast truncates); a later ``.to(bf16)`` is exact.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def paged_write_kernel(
    x_ptr,
    stride_xt,
    stride_xh,
    rot_ptr,
    stride_rh,
    stride_rr,
    mean_ptr,
    stride_mh,
    alpha_ptr,
    slot_ptr,
    pos_ptr,
    seqidx_ptr,
    seqlen_ptr,
    wslot_ptr,
    codes_ptr,
    stride_cp,
    stride_ch,
    stride_ct,
    scale_ptr,
    zero_ptr,
    stride_sp,
    stride_sh,
    stride_st,
    sink_ptr,
    stride_ks,
    stride_kh,
    stride_kt,
    ring_ptr,
    stride_rs,
    stride_rgh,
    stride_rt,
    n_tokens,
    page_size,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One program: ``BLOCK_T`` tokens of one KV head (``program_id(1)``) of K or V."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tokens
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    valid = tmask & (slot >= 0)
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + t[:, None] * stride_xt + h * stride_xh + d[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    if HAS_MEAN:
        x = x - tl.load(mean_ptr + h * stride_mh + d).to(tl.float32)[None, :]
    rot = tl.load(rot_ptr + h * stride_rh + d[:, None] * stride_rr + d[None, :]).to(tl.float32)
    xr = tl.dot(x, rot, input_precision=DOT_PRECISION)  # [BLOCK_T, d] rotated rows

    # per-group clipped min/max -> bf16 scale/zero, exactly as oscar_math.quantize_int2
    NG: tl.constexpr = HEAD_DIM // GROUP
    g3 = tl.reshape(xr, (BLOCK_T, NG, GROUP))
    mn = tl.min(g3, axis=2)
    mx = tl.max(g3, axis=2)
    alpha = tl.load(alpha_ptr + h).to(tl.float32)
    lo = tl.where(mn < 0, mn * alpha, mn)
    hi = tl.where(mx > 0, mx * alpha, mx)
    zero_b = round_bf16(lo).to(tl.bfloat16)
    scale_b = round_bf16(tl.math.div_rn(hi - lo, 3.0)).to(tl.bfloat16)
    z = zero_b.to(tl.float32)
    s = scale_b.to(tl.float32)
    inv = tl.where(s > 0, tl.math.div_rn(1.0, tl.where(s > 0, s, 1.0)), 0.0)
    c = tl.floor((g3 - z[:, :, None]) * inv[:, :, None] + 0.5)
    c = tl.minimum(tl.maximum(c, 0.0), 3.0).to(tl.int32)
    # strided packing: byte b = c[b] | c[b + d/4] << 2 | c[b + d/2] << 4 | c[b + 3d/4] << 6
    Q4: tl.constexpr = HEAD_DIM // 4
    c4 = tl.reshape(c, (BLOCK_T, 4, Q4))
    shifts = 2 * tl.arange(0, 4)
    packed = tl.sum(c4 << shifts[None, :, None], axis=1).to(tl.uint8)

    page = slot // page_size
    off = slot % page_size
    row = page * stride_cp + h * stride_ch + off * stride_ct
    j = tl.arange(0, Q4)
    tl.store(codes_ptr + row[:, None] + j[None, :], packed, mask=valid[:, None])
    gi = tl.arange(0, NG)
    mrow = page * stride_sp + h * stride_sh + off * stride_st
    tl.store(scale_ptr + mrow[:, None] + gi[None, :], scale_b, mask=valid[:, None])
    tl.store(zero_ptr + mrow[:, None] + gi[None, :], zero_b, mask=valid[:, None])

    if SINK + RECENT > 0:
        pos = tl.load(pos_ptr + t, mask=valid, other=0)
        sidx = tl.load(seqidx_ptr + t, mask=valid, other=0)
        length = tl.load(seqlen_ptr + sidx, mask=valid, other=0)
        ws = tl.load(wslot_ptr + sidx, mask=valid, other=0).to(tl.int64)
        xb = round_bf16(xr).to(tl.bfloat16)
        if SINK > 0:
            m = valid & (pos < SINK)
            p = tl.where(m, pos, 0)
            tl.store(
                sink_ptr + (ws * stride_ks + h * stride_kh + p * stride_kt)[:, None] + d[None, :],
                xb,
                mask=m[:, None],
            )
        if RECENT > 0:
            m = valid & (pos >= SINK) & (pos >= length - RECENT)
            p = tl.where(m, pos % RECENT, 0)
            tl.store(
                ring_ptr + (ws * stride_rs + h * stride_rgh + p * stride_rt)[:, None] + d[None, :],
                xb,
                mask=m[:, None],
            )
