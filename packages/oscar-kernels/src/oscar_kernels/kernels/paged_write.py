"""Fused write: rotate, centre, clip, min/max, quantise, pack, store (+ BF16 windows)."""

from __future__ import annotations

import triton
import triton.language as tl

try:  # programmatic dependent launch (sm_90+): a decode step's query rotation starts beside the window pass
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # an older Triton: TRIGGER=False everywhere (decode_attention.pdl_available)
    gdc_launch_dependents = None


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
def _stamp(probe_ptr, i: tl.constexpr, dep):
    """``PROBE`` only (a diagnosis, off in the product): the GPU's nanosecond timer into slot ``i``
    of this program's probe row, read after ``dep`` (a value of the phase just ended) is ready,
    so the stamp cannot move above that phase's last result."""
    prog = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    d = dep.to(tl.int32, bitcast=True) if dep.dtype == tl.float32 else dep.to(tl.int32)
    c = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,r", [d], dtype=tl.int64, is_pure=False, pack=1
    )
    tl.store(probe_ptr + prog.to(tl.int64) * 16 + i, c)


@triton.jit
def _prefetch_l1(ptrs):
    """Ask for the lines at ``ptrs`` into L1 (``prefetch.global.L1``; GPU builds only, the
    interpreter runs no PTX). A prefetch never faults, writes no register and changes no value."""
    tl.inline_asm_elementwise(
        "prefetch.global.L1 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_f(fb_ptr, stride_fr, stride_fc, HEAD_DIM: tl.constexpr):
    """``PREFETCH``: this head's ``F`` into L1 before the rotation, one request per 32 rows of each
    column (a 128-byte line of a column-major ``F``). The feedback loop's ``d/4`` steps each wait
    on their columns' loads; from the memory (``F`` is evicted from L2 between layers by the
    weights) that latency was most of a decode write."""
    NR: tl.constexpr = (HEAD_DIM + 31) // 32  # at least one row block (d = 16: one)
    r = tl.arange(0, NR) * 32
    c = tl.arange(0, HEAD_DIM)
    _prefetch_l1(fb_ptr + r[:, None] * stride_fr + c[None, :] * stride_fc)


@triton.jit
def _prefetch_rotation(rot_ptr, stride_rr, HEAD_DIM: tl.constexpr):
    """``PREFETCH``: this head's ``R`` (row-major, columns contiguous) into L1 at the program's
    start, one request per 32 columns of each row. The rotation's four quarters (eight halves with
    the pre-RoPE mean) each load their ``R`` columns after the dot before them (a block barrier
    between): from the memory (``R`` is evicted from L2 between layers like ``F``) each was a
    round trip of its own, with the prefetch an L1 hit behind one."""
    NC: tl.constexpr = (HEAD_DIM + 31) // 32
    r = tl.arange(0, HEAD_DIM)
    c = tl.arange(0, NC) * 32
    _prefetch_l1(rot_ptr + r[:, None] * stride_rr + c[None, :])


@triton.jit
def _store_quarters(row_ptr, m, x0, x1, x2, x3, Q4: tl.constexpr):
    """Store four ``[BLOCK_T, Q4]`` quarters as bf16 rows starting at ``row_ptr``."""
    j = tl.arange(0, Q4)
    ptr = row_ptr[:, None] + j[None, :]
    m2 = m[:, None]
    tl.store(ptr, round_bf16(x0).to(tl.bfloat16), mask=m2)
    tl.store(ptr + Q4, round_bf16(x1).to(tl.bfloat16), mask=m2)
    tl.store(ptr + 2 * Q4, round_bf16(x2).to(tl.bfloat16), mask=m2)
    tl.store(ptr + 3 * Q4, round_bf16(x3).to(tl.bfloat16), mask=m2)


@triton.jit
def _load_rows(
    x_ptr, stride_xt, stride_xh, mean_ptr, stride_mh, t, h, valid,
    HEAD_DIM: tl.constexpr, HAS_MEAN: tl.constexpr,
):  # fmt: skip
    """Rows ``t`` of head ``h`` as ``[BLOCK_T, d]`` float32, minus the key mean."""
    d = tl.arange(0, HEAD_DIM)
    x = tl.load(x_ptr + t[:, None] * stride_xt + h * stride_xh + d[None, :], mask=valid[:, None], other=0.0)
    x = x.to(tl.float32)
    if HAS_MEAN:
        x = x - tl.load(mean_ptr + h * stride_mh + d).to(tl.float32)[None, :]
    return x


@triton.jit
def _rotate(x, rot_ptr, stride_rh, stride_rr, h, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``x @ R`` of head ``h`` as four ``[BLOCK_T, d/4]`` quarters.

    Quarter ``i`` of ``x @ R`` is ``x @ R[:, i*d/4:(i+1)*d/4]``, which is exactly what byte
    lane ``i`` of the strided packing holds (no reshapes needed)."""
    d = tl.arange(0, HEAD_DIM)
    Q4: tl.constexpr = HEAD_DIM // 4
    j = tl.arange(0, Q4)
    rbase = rot_ptr + h * stride_rh + d[:, None] * stride_rr + j[None, :]
    x0 = tl.dot(x, tl.load(rbase).to(tl.float32), input_precision=DOT_PRECISION)
    x1 = tl.dot(x, tl.load(rbase + Q4).to(tl.float32), input_precision=DOT_PRECISION)
    x2 = tl.dot(x, tl.load(rbase + 2 * Q4).to(tl.float32), input_precision=DOT_PRECISION)
    x3 = tl.dot(x, tl.load(rbase + 3 * Q4).to(tl.float32), input_precision=DOT_PRECISION)
    return x0, x1, x2, x3


@triton.jit
def _rotate_rows(
    x_ptr, stride_xt, stride_xh, rot_ptr, stride_rh, stride_rr, mean_ptr, stride_mh, t, h, valid,
    HEAD_DIM: tl.constexpr, HAS_MEAN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Rows ``t`` of head ``h`` (minus the mean), rotated, as four ``[BLOCK_T, d/4]`` quarters."""
    x = _load_rows(x_ptr, stride_xt, stride_xh, mean_ptr, stride_mh, t, h, valid, HEAD_DIM, HAS_MEAN)
    return _rotate(x, rot_ptr, stride_rh, stride_rr, h, HEAD_DIM, DOT_PRECISION)


@triton.jit
def _cos_sin(a):
    """``cos(a), sin(a)`` of float32 angles in plain float32 arithmetic (no FMA fusion in this
    kernel: the same bits on the GPU and in the interpreter, whatever the backend's cos/sin).

    ``a`` is reduced by ``2π`` (Cody–Waite, three float32 parts; ``k·6.28125`` is exact for
    ``|a| < 2^16·2π ≈ 4·10^5``) and then by the quadrant ``j·π/2`` (``|j| ≤ 2``, two parts) to
    ``|r| ≤ π/4``, where Cephes' ``sinf``/``cosf`` polynomials are accurate to about an ulp."""
    k = tl.floor(a * 0.15915494309189535 + 0.5)
    r = a - k * 6.28125
    r = r - k * 0.0019378662109375
    r = r + k * 2.559031372584286e-06  # (the second part is rounded up)
    j = tl.floor(r * 0.6366197723675814 + 0.5)  # quadrant, -2..2
    r = r - j * 1.5703125
    r = r - j * 0.0004838267923332751
    z = r * r
    s = ((-1.9515295891e-4 * z + 8.3321608736e-3) * z - 1.6666654611e-1) * z * r + r
    c = ((2.443315711809948e-5 * z - 1.388731625493765e-3) * z + 4.166664568298827e-2) * z * z - 0.5 * z + 1.0
    q = j.to(tl.int32) & 3  # cos(r + qπ/2), sin(r + qπ/2)
    cos = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
    return cos, sin


@triton.jit
def _centred_rotated_rows(
    x_ptr, stride_xt, stride_xh, rot_ptr, stride_rh, stride_rr, mean_ptr, stride_mh, rmean_ptr, stride_rmh,
    freq_ptr, pos, t, h, valid, HEAD_DIM: tl.constexpr, HAS_MEAN: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """``(x − mean − RoPE_p(m)) @ R`` of rows ``t`` of head ``h`` as four ``[BLOCK_T, d/4]`` quarters.

    Rotate-half layout (:mod:`oscar_math.rope_center`): pair ``i`` (coordinates ``i`` and
    ``i + d/2``) of ``RoPE_p(m)`` is ``(a·cos − b·sin, b·cos + a·sin)`` at angle ``p·θ_i``,
    ``(a, b) = (m_i, m_{i+d/2})``; the angle is one float32 product (its rounding,
    ``2^-24·p·θ_i`` rad, is what the float64 reference does not have). The rows are held as
    their two halves (one angle per pair, no joins) and rotated as
    ``x_lo @ R[:d/2] + x_hi @ R[d/2:]``; for ``d < 32`` (whose halves are too narrow for a
    ``tl.dot`` on Triton < 3.9: K >= 16) as whole rows, the offset computed per column."""
    HALF: tl.constexpr = HEAD_DIM // 2
    Q4: tl.constexpr = HEAD_DIM // 4
    if HALF < 16:
        # column c of pair c mod d/2: m_c·cos + m'_c·sin with m' = (−m[d/2:], m[:d/2])
        d = tl.arange(0, HEAD_DIM)
        low = d < HALF
        x = _load_rows(x_ptr, stride_xt, stride_xh, mean_ptr, stride_mh, t, h, valid, HEAD_DIM, HAS_MEAN)
        m = tl.load(rmean_ptr + h * stride_rmh + d).to(tl.float32)[None, :]
        mp = tl.load(rmean_ptr + h * stride_rmh + tl.where(low, d + HALF, d - HALF)).to(tl.float32)[None, :]
        theta = tl.load(freq_ptr + tl.where(low, d, d - HALF)).to(tl.float32)
        cos, sin = _cos_sin(pos.to(tl.float32)[:, None] * theta[None, :])
        x = x - tl.where(low[None, :], m * cos - mp * sin, m * cos + mp * sin)
        x0, x1, x2, x3 = _rotate(x, rot_ptr, stride_rh, stride_rr, h, HEAD_DIM, DOT_PRECISION)
    else:
        i = tl.arange(0, HALF)
        rows = x_ptr + t[:, None] * stride_xt + h * stride_xh + i[None, :]
        xlo = tl.load(rows, mask=valid[:, None], other=0.0).to(tl.float32)
        xhi = tl.load(rows + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
        if HAS_MEAN:
            xlo = xlo - tl.load(mean_ptr + h * stride_mh + i).to(tl.float32)[None, :]
            xhi = xhi - tl.load(mean_ptr + h * stride_mh + HALF + i).to(tl.float32)[None, :]
        a = tl.load(rmean_ptr + h * stride_rmh + i).to(tl.float32)[None, :]
        b = tl.load(rmean_ptr + h * stride_rmh + HALF + i).to(tl.float32)[None, :]
        cos, sin = _cos_sin(pos.to(tl.float32)[:, None] * tl.load(freq_ptr + i).to(tl.float32)[None, :])
        xlo = xlo - (a * cos - b * sin)
        xhi = xhi - (b * cos + a * sin)
        j = tl.arange(0, Q4)
        rlo = rot_ptr + h * stride_rh + i[:, None] * stride_rr + j[None, :]
        rhi = rlo + HALF * stride_rr
        x0 = tl.dot(xlo, tl.load(rlo).to(tl.float32), input_precision=DOT_PRECISION)
        x0 = tl.dot(xhi, tl.load(rhi).to(tl.float32), acc=x0, input_precision=DOT_PRECISION)
        x1 = tl.dot(xlo, tl.load(rlo + Q4).to(tl.float32), input_precision=DOT_PRECISION)
        x1 = tl.dot(xhi, tl.load(rhi + Q4).to(tl.float32), acc=x1, input_precision=DOT_PRECISION)
        x2 = tl.dot(xlo, tl.load(rlo + 2 * Q4).to(tl.float32), input_precision=DOT_PRECISION)
        x2 = tl.dot(xhi, tl.load(rhi + 2 * Q4).to(tl.float32), acc=x2, input_precision=DOT_PRECISION)
        x3 = tl.dot(xlo, tl.load(rlo + 3 * Q4).to(tl.float32), input_precision=DOT_PRECISION)
        x3 = tl.dot(xhi, tl.load(rhi + 3 * Q4).to(tl.float32), acc=x3, input_precision=DOT_PRECISION)
    return x0, x1, x2, x3


@triton.jit
def _quarter(Q: tl.constexpr, x0, x1, x2, x3):
    """Quarter ``Q`` (a compile-time index) of a row held as four quarters."""
    if Q == 0:
        return x0
    elif Q == 1:
        return x1
    elif Q == 2:
        return x2
    else:
        return x3


@triton.jit
def _lane(sel, x, lane, GATHER: tl.constexpr):
    """Lane ``lane`` of the ``[rows, Q]`` quarter ``x`` (``sel``: the one-hot ``[1, Q]`` mask of
    that lane) as ``[rows, 1]``. ``GATHER`` (a row per warp, one element a thread: the decode
    write's chunks): ``tl.gather``, one ``shfl.sync.idx`` (in a tile of several elements a thread
    the gather goes through shared memory); else a masked sum, a butterfly of shuffles. Both exact
    (the sum's other terms are +0.0: a -0.0 comes back as +0.0, which rounds and feeds back alike)."""
    if GATHER:
        return tl.gather(x, tl.zeros([x.shape[0], 1], tl.int32) + lane, 1)
    else:
        return tl.sum(tl.where(sel, x, 0.0), 1)[:, None]


@triton.jit
def _stage(scr_ptr, x0, x1, x2, x3, BLOCK_T: tl.constexpr, Q4: tl.constexpr):
    """The four ``[BLOCK_T, Q4]`` quarters into this program's float32 scratch (quarter ``i`` at
    ``i·BLOCK_T·Q4``, rows of ``Q4``), every warp's stores before any warp's loads: the feedback
    loop reads them back (:func:`_unstage`) in a load's layout. The ``tl.dot`` (MMA) layout
    spreads a quarter's columns over warps, so each of the loop's cross-lane picks cost two block
    barriers there (sm_90 PTX: 10 ``bar.sync`` per coordinate); a load's layout keeps a row's
    columns in one warp (shuffles only, none)."""
    T: tl.constexpr = BLOCK_T * Q4
    w = tl.arange(0, BLOCK_T)[:, None] * Q4 + tl.arange(0, Q4)[None, :]
    tl.store(scr_ptr + w, x0)
    tl.store(scr_ptr + T + w, x1)
    tl.store(scr_ptr + 2 * T + w, x2)
    tl.store(scr_ptr + 3 * T + w, x3)
    tl.debug_barrier()


@triton.jit
def _unstage(scr_ptr, BLOCK_T: tl.constexpr, ROWS: tl.constexpr, Q4: tl.constexpr):
    """``ROWS`` staged rows from ``scr_ptr`` (a row of quarter 0) as four ``[ROWS, Q4]`` quarters.
    With ``ROWS`` = the warps, each thread holds one element of a quarter."""
    T: tl.constexpr = BLOCK_T * Q4
    r = tl.arange(0, ROWS)[:, None] * Q4 + tl.arange(0, Q4)[None, :]
    y0, y1 = tl.load(scr_ptr + r), tl.load(scr_ptr + T + r)
    return y0, y1, tl.load(scr_ptr + 2 * T + r), tl.load(scr_ptr + 3 * T + r)


@triton.jit
def _lanes4(x, sa, sb, sc, sd, lane, GATHER: tl.constexpr):
    """Lanes ``lane .. lane+3`` of ``x`` (masks ``sa .. sd``), side by side (:func:`_lane`)."""
    a, b = _lane(sa, x, lane, GATHER), _lane(sb, x, lane + 1, GATHER)
    return a, b, _lane(sc, x, lane + 2, GATHER), _lane(sd, x, lane + 3, GATHER)


@triton.jit
def _code_err(tc, zc, ic, xc, sc):
    """One coordinate's code and rounding error from its running target ``tc`` (per token)."""
    code = tl.minimum(tl.maximum(tl.floor((tc - zc) * ic + 0.5), 0.0), 3.0)
    return code, xc - (code * sc + zc)


@triton.jit
def _spread(Q: tl.constexpr, sel, code, err, col, stride_fr, k, t0, t1, t2, t3, Q4: tl.constexpr):
    """Coordinate ``c`` (lane ``sel`` of quarter ``Q``) done: its code into ``k`` (that quarter's
    codes) and its error times column ``c`` of ``F`` (``col``: ``F[j, c]`` for the lanes ``j`` of
    quarter 0; ``stride_fr``: F's row stride) added to the targets of the quarters that still hold
    later coordinates."""
    k = tl.where(sel, code.to(tl.int32), k)
    e = err
    if Q == 0:
        t0 = t0 + e * tl.load(col).to(tl.float32)[None, :]
    if Q <= 1:
        t1 = t1 + e * tl.load(col + Q4 * stride_fr).to(tl.float32)[None, :]
    if Q <= 2:
        t2 = t2 + e * tl.load(col + 2 * Q4 * stride_fr).to(tl.float32)[None, :]
    t3 = t3 + e * tl.load(col + 3 * Q4 * stride_fr).to(tl.float32)[None, :]
    return k, t0, t1, t2, t3


@triton.jit
def _chain4(ta, tb, tc, td, xa, xb, xc, xd, zg, ig, sg, f, stride_fr, stride_fc):
    """Four consecutive coordinates ``c .. c+3`` of one quantisation group rounded in order from
    their picked targets ``ta .. td`` (per token), each error added to the later three's targets
    with the scalar ``F`` entries (``f``: ``F[c, c]``). Returns the four codes and errors."""
    f10 = tl.load(f + stride_fr).to(tl.float32)
    f20 = tl.load(f + 2 * stride_fr).to(tl.float32)
    f21 = tl.load(f + 2 * stride_fr + stride_fc).to(tl.float32)
    f30 = tl.load(f + 3 * stride_fr).to(tl.float32)
    f31 = tl.load(f + 3 * stride_fr + stride_fc).to(tl.float32)
    f32 = tl.load(f + 3 * stride_fr + 2 * stride_fc).to(tl.float32)
    ca, ea = _code_err(ta, zg, ig, xa, sg)
    tb = tb + ea * f10
    tc = tc + ea * f20
    td = td + ea * f30
    cb, eb = _code_err(tb, zg, ig, xb, sg)
    tc = tc + eb * f21
    td = td + eb * f31
    cc, ec = _code_err(tc, zg, ig, xc, sg)
    td = td + ec * f32
    cd, ed = _code_err(td, zg, ig, xd, sg)
    return ca, cb, cc, cd, ea, eb, ec, ed


@triton.jit
def _cross(t, ea, eb, ec, ed, f, stride_fc):
    """A later coordinate's picked target ``t`` (row of ``F`` at ``f``: ``F[r, c]``) after the
    errors of coordinates ``c .. c+3``, added one at a time in coordinate order."""
    t = t + ea * tl.load(f).to(tl.float32)
    t = t + eb * tl.load(f + stride_fc).to(tl.float32)
    t = t + ec * tl.load(f + 2 * stride_fc).to(tl.float32)
    return t + ed * tl.load(f + 3 * stride_fc).to(tl.float32)


@triton.jit
def _set_quarter(q: tl.constexpr, kq, k0, k1, k2, k3):
    """``k0 .. k3`` with quarter ``q`` (a compile-time index) replaced by ``kq``."""
    if q == 0:
        k0 = kq
    if q == 1:
        k1 = kq
    if q == 2:
        k2 = kq
    if q == 3:
        k3 = kq
    return k0, k1, k2, k3


@triton.jit
def _feedback_codes(
    x0, x1, x2, x3, z0, z1, z2, z3, i0, i1, i2, i3, s0, s1, s2, s3, fb_ptr, stride_fr, stride_fc,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GATHER: tl.constexpr = False, probe_ptr=None,
    PROBE: tl.constexpr = False,
):  # fmt: skip
    """Error-feedback codes, exactly as ``oscar_math.quantize_int2_feedback``.

    Coordinates are rounded in order ``c = 0 .. d-1`` (quarter ``c // (d/4)``, lane
    ``c % (d/4)``); after each, its error ``e_c = x_c − x̂_c`` is added to the targets of the
    later coordinates times column ``c`` of the strictly lower-triangular ``F`` (entries on and
    above the diagonal are zero, so adding to every coordinate changes only the later ones).
    ``fb_ptr`` points at ``F`` of this head, row stride ``stride_fr``, column stride
    ``stride_fc``. Each step reads its columns of ``F``: stored column-major (``stride_fr`` 1,
    as :meth:`LayerQuantParams.expand` keeps it) a column is one contiguous run, not ``d/4``
    lines a quarter. Returns the four quarters' int32 codes.

    Several coordinates a step — eight in a decode write's chunks (``GATHER``) where a quarter
    holds a multiple of eight (``d`` a multiple of 32), else four (``d`` is a multiple of 16): their
    targets are picked out of the
    quarter at once (cross-lane sums, side by side), the roundings run on the picked per-token
    values in runs of four (:func:`_chain4`, the scalar ``F`` entries between them; a second run's
    targets first take the first run's errors, :func:`_cross`), and only then do the step's errors
    reach the quarters' targets, in coordinate order. Every target receives the same float32
    products in the same order as the reference, so the codes are the same bits; the serial chain
    loses the cross-lane picks of all but one coordinate a step (one pick per coordinate made a
    one-token decode write 15.6 µs on the H100; four a step ~0.5 µs a step there). ``GATHER``
    (a decode write's chunks, one element a thread): each pick one shuffle (:func:`_lane`)."""
    Q4: tl.constexpr = HEAD_DIM // 4
    # eight a step in the chunks only, where a pick is one shuffle: over a whole tile (butterfly
    # picks, more elements a thread) the step's 16 extra uniform F loads are what made a tried
    # look-ahead slower on the H100 (lab/NOTES_performance_runs.md); the tile keeps the measured four
    STEP: tl.constexpr = 8 if (GATHER and Q4 % 8 == 0) else 4
    # eight coordinates of a step span two groups when groups hold four
    SPLIT_GROUP: tl.constexpr = GROUP % 8 != 0
    j = tl.arange(0, Q4)
    t0, t1, t2, t3 = x0, x1, x2, x3
    k0 = tl.zeros(x0.shape, tl.int32)
    k1 = tl.zeros(x0.shape, tl.int32)
    k2 = tl.zeros(x0.shape, tl.int32)
    k3 = tl.zeros(x0.shape, tl.int32)
    fr, fc = stride_fr, stride_fc
    for q in tl.static_range(4):
        xq = _quarter(q, x0, x1, x2, x3)
        zq = _quarter(q, z0, z1, z2, z3)
        iq = _quarter(q, i0, i1, i2, i3)
        sq = _quarter(q, s0, s1, s2, s3)
        for l0 in range(0, Q4, STEP):
            c = q * Q4 + l0  # the step's first coordinate
            sa, sb = (j == l0)[None, :], (j == l0 + 1)[None, :]
            sc, sd = (j == l0 + 2)[None, :], (j == l0 + 3)[None, :]
            tq = _quarter(q, t0, t1, t2, t3)
            ta, tb, tc, td = _lanes4(tq, sa, sb, sc, sd, l0, GATHER)
            # the four share a quantisation group (groups are >= 4 aligned coordinates): one
            # zero, inverse scale and scale for them
            zg, ig, sg = _lane(sa, zq, l0, GATHER), _lane(sa, iq, l0, GATHER), _lane(sa, sq, l0, GATHER)
            f = fb_ptr + c * stride_fr + c * stride_fc  # F[c, c]
            col = fb_ptr + j * stride_fr + c * stride_fc  # F[j, c] for the lanes of quarter 0
            kq = _quarter(q, k0, k1, k2, k3)
            xa, xb, xc, xd = _lanes4(xq, sa, sb, sc, sd, l0, GATHER)
            ca, cb, cc, cd, ea, eb, ec, ed = _chain4(ta, tb, tc, td, xa, xb, xc, xd, zg, ig, sg, f, fr, fc)
            if STEP == 8:
                se, sf = (j == l0 + 4)[None, :], (j == l0 + 5)[None, :]
                s6, sh = (j == l0 + 6)[None, :], (j == l0 + 7)[None, :]
                te, tf, tg, th = _lanes4(tq, se, sf, s6, sh, l0 + 4, GATHER)
                if SPLIT_GROUP:  # the second run in the next group of four
                    zg = _lane(se, zq, l0 + 4, GATHER)
                    ig = _lane(se, iq, l0 + 4, GATHER)
                    sg = _lane(se, sq, l0 + 4, GATHER)
                # the second run's targets after the first run's errors (F[c+4+r, c .. c+3])
                te = _cross(te, ea, eb, ec, ed, f + 4 * fr, fc)
                tf = _cross(tf, ea, eb, ec, ed, f + 5 * fr, fc)
                tg = _cross(tg, ea, eb, ec, ed, f + 6 * fr, fc)
                th = _cross(th, ea, eb, ec, ed, f + 7 * fr, fc)
                xe, xf, xg, xh = _lanes4(xq, se, sf, s6, sh, l0 + 4, GATHER)
                ce, cf, cg, ch, ee, ef, eg, eh = _chain4(
                    te, tf, tg, th, xe, xf, xg, xh, zg, ig, sg, f + 4 * fr + 4 * fc, fr, fc
                )
            kq, t0, t1, t2, t3 = _spread(q, sa, ca, ea, col, fr, kq, t0, t1, t2, t3, Q4)
            kq, t0, t1, t2, t3 = _spread(q, sb, cb, eb, col + fc, fr, kq, t0, t1, t2, t3, Q4)
            kq, t0, t1, t2, t3 = _spread(q, sc, cc, ec, col + 2 * fc, fr, kq, t0, t1, t2, t3, Q4)
            kq, t0, t1, t2, t3 = _spread(q, sd, cd, ed, col + 3 * fc, fr, kq, t0, t1, t2, t3, Q4)
            if STEP == 8:
                kq, t0, t1, t2, t3 = _spread(q, se, ce, ee, col + 4 * fc, fr, kq, t0, t1, t2, t3, Q4)
                kq, t0, t1, t2, t3 = _spread(q, sf, cf, ef, col + 5 * fc, fr, kq, t0, t1, t2, t3, Q4)
                kq, t0, t1, t2, t3 = _spread(q, s6, cg, eg, col + 6 * fc, fr, kq, t0, t1, t2, t3, Q4)
                kq, t0, t1, t2, t3 = _spread(q, sh, ch, eh, col + 7 * fc, fr, kq, t0, t1, t2, t3, Q4)
            k0, k1, k2, k3 = _set_quarter(q, kq, k0, k1, k2, k3)
        if PROBE:  # after quarter q's coordinates: slots 4..7
            _stamp(probe_ptr, 4 + q, tl.sum(tl.sum(_quarter(q, k0, k1, k2, k3), 1), 0))
    return k0, k1, k2, k3


@triton.jit
def _int2_rows(
    x0, x1, x2, x3, slot, valid, h, alpha_ptr, fb_ptr, stride_fr, stride_fc, codes_ptr, stride_cp, stride_ch,
    stride_ct, scale_ptr, zero_ptr, stride_sp, stride_sh, stride_st, page_size, HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr, HAS_FEEDBACK: tl.constexpr, GATHER: tl.constexpr = False, probe_ptr=None,
    PROBE: tl.constexpr = False,
):  # fmt: skip
    """The INT2 rows of rotated ``[rows, d]`` quarters ``x0 .. x3`` (tokens whose cache slot is
    ``slot``, stored where ``valid``): per-group clipped min/max → bf16 scale/zero, codes (plain
    rounding or error feedback with this head's ``F`` at ``fb_ptr``), strided packing."""
    Q4: tl.constexpr = HEAD_DIM // 4
    j = tl.arange(0, Q4)
    alpha = tl.load(alpha_ptr + h).to(tl.float32)
    # per-group clipped min/max -> bf16 scale/zero, exactly as oscar_math.quantize_int2
    page = slot // page_size
    off = slot % page_size
    mrow = page * stride_sp + h * stride_sh + off * stride_st
    NG: tl.constexpr = HEAD_DIM // GROUP
    # each group's zero, inverse scale and scale over its columns, per quarter (values: one start)
    none = tl.zeros(x0.shape, tl.float32)
    z0, z1, z2, z3 = none, none, none, none
    i0, i1, i2, i3 = none, none, none, none
    s0, s1, s2, s3 = none, none, none, none
    for g in tl.static_range(NG):
        # column masks of group g inside each quarter
        c0 = (j // GROUP) == g
        c1 = ((j + Q4) // GROUP) == g
        c2 = ((j + 2 * Q4) // GROUP) == g
        c3 = ((j + 3 * Q4) // GROUP) == g
        mn = tl.minimum(
            tl.minimum(
                tl.min(tl.where(c0[None, :], x0, float("inf")), 1),
                tl.min(tl.where(c1[None, :], x1, float("inf")), 1),
            ),
            tl.minimum(
                tl.min(tl.where(c2[None, :], x2, float("inf")), 1),
                tl.min(tl.where(c3[None, :], x3, float("inf")), 1),
            ),
        )
        mx = tl.maximum(
            tl.maximum(
                tl.max(tl.where(c0[None, :], x0, -float("inf")), 1),
                tl.max(tl.where(c1[None, :], x1, -float("inf")), 1),
            ),
            tl.maximum(
                tl.max(tl.where(c2[None, :], x2, -float("inf")), 1),
                tl.max(tl.where(c3[None, :], x3, -float("inf")), 1),
            ),
        )
        lo = tl.where(mn < 0, mn * alpha, mn)
        hi = tl.where(mx > 0, mx * alpha, mx)
        z = round_bf16(lo)
        sc = round_bf16(tl.math.div_rn(hi - lo, 3.0))
        inv = tl.where(sc > 0, tl.math.div_rn(1.0, tl.where(sc > 0, sc, 1.0)), 0.0)
        tl.store(scale_ptr + mrow + g, sc.to(tl.bfloat16), mask=valid)
        tl.store(zero_ptr + mrow + g, z.to(tl.bfloat16), mask=valid)
        z0 = tl.where(c0[None, :], z[:, None], z0)
        z1 = tl.where(c1[None, :], z[:, None], z1)
        z2 = tl.where(c2[None, :], z[:, None], z2)
        z3 = tl.where(c3[None, :], z[:, None], z3)
        i0 = tl.where(c0[None, :], inv[:, None], i0)
        i1 = tl.where(c1[None, :], inv[:, None], i1)
        i2 = tl.where(c2[None, :], inv[:, None], i2)
        i3 = tl.where(c3[None, :], inv[:, None], i3)
        if HAS_FEEDBACK:
            s0 = tl.where(c0[None, :], sc[:, None], s0)
            s1 = tl.where(c1[None, :], sc[:, None], s1)
            s2 = tl.where(c2[None, :], sc[:, None], s2)
            s3 = tl.where(c3[None, :], sc[:, None], s3)
    if PROBE:
        _stamp(probe_ptr, 3, tl.sum(tl.sum(i3, 1), 0))
    if HAS_FEEDBACK:
        k0, k1, k2, k3 = _feedback_codes(
            x0, x1, x2, x3, z0, z1, z2, z3, i0, i1, i2, i3, s0, s1, s2, s3,
            fb_ptr, stride_fr, stride_fc, HEAD_DIM, GROUP, GATHER, probe_ptr, PROBE,
        )  # fmt: skip
    else:
        # code = clamp(floor((x - zero) * inv + 0.5), 0, 3); strided packing, quarter i at bits 2i
        k0 = tl.minimum(tl.maximum(tl.floor((x0 - z0) * i0 + 0.5), 0.0), 3.0).to(tl.int32)
        k1 = tl.minimum(tl.maximum(tl.floor((x1 - z1) * i1 + 0.5), 0.0), 3.0).to(tl.int32)
        k2 = tl.minimum(tl.maximum(tl.floor((x2 - z2) * i2 + 0.5), 0.0), 3.0).to(tl.int32)
        k3 = tl.minimum(tl.maximum(tl.floor((x3 - z3) * i3 + 0.5), 0.0), 3.0).to(tl.int32)
    packed = (k0 | (k1 << 2) | (k2 << 4) | (k3 << 6)).to(tl.uint8)
    row = page * stride_cp + h * stride_ch + off * stride_ct
    tl.store(codes_ptr + row[:, None] + j[None, :], packed, mask=valid[:, None])


# n_tokens only bounds the tiles: one compile for every token count of a tile size
@triton.jit(do_not_specialize=["n_tokens"])
def paged_write_kernel(
    x_ptr,
    stride_xt,
    stride_xh,
    rot_ptr,
    stride_rh,
    stride_rr,
    mean_ptr,
    stride_mh,
    rmean_ptr,
    stride_rmh,
    freq_ptr,
    alpha_ptr,
    fb_ptr,
    stride_fh,
    stride_fr,
    stride_fc,
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
    scr_ptr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    HAS_MEAN: tl.constexpr,
    HAS_FEEDBACK: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    WRITE_PAGES: tl.constexpr,
    WRITE_RING: tl.constexpr,
    WRITE_SINK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    H_BASE: tl.constexpr = 0,
    probe_ptr=None,
    PROBE: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    FB_ROWS: tl.constexpr = 0,
):
    """One program: ``BLOCK_T`` tokens (``program_id(0)``) of KV head ``program_id(1) - H_BASE`` of
    K or V (``H_BASE``: where this tensor's heads start in :func:`paged_write_kv_kernel`'s grid).

    ``WRITE_PAGES``: the INT2 row; ``WRITE_SINK``: the sink row; ``WRITE_RING``: the ring row
    (``paged_write``'s ``parts``). The ring pass after an extend returns before the rotation when
    none of its tokens holds a ring row: a chunk longer than the window stores only its last
    ``recent`` rows per sequence. A decode step's window pass (``parts="window"``) has no such
    return (every real token of it stores a row) and loads its rows beside its bookkeeping.

    ``HAS_ROPE`` (a pre-RoPE key mean, format version 3): the INT2 rows quantise
    ``(x − mean − RoPE_p(m)) @ R``; the BF16 rows keep ``(x − mean) @ R``, rotated a second
    time from a reload of the rows, only in blocks that hold a BF16 row (after the INT2
    stores, so the two rotated rows are never live together). Without it this is the
    kernel of format versions 1 and 2, unchanged.

    ``PROBE`` (diagnosis only; ``probe_ptr``: int64, 16 slots per program, program ``pid ·
    num_programs(1) + program_id(1)``): the GPU timer at the start (0), after the rotation (1), the
    feedback staging and a chunk's read-back (2), the group statistics (3), each feedback quarter
    (4-7) and the end (8); slots 2-7 of the program's last row chunk:
    where a decode write's time goes (``lab/gpu_vllm/write_phases.py``).

    ``PREFETCH`` (every GPU launch; off under the interpreter): the rotation's and the feedback
    matrix's prefetch into L1 (:func:`_prefetch_rotation`, :func:`_prefetch_f`).
    """
    pid = tl.program_id(0)
    h = tl.program_id(1) - H_BASE
    if PROBE:
        _stamp(probe_ptr, 0, pid)
    # a decode step's window pass (BF16 rows only, sink and ring): every real token stores a row,
    # so it has no early return, and its row loads wait on nothing but the token count
    WINDOW_PASS: tl.constexpr = WRITE_SINK and WRITE_RING and not WRITE_PAGES
    if PREFETCH and (WRITE_PAGES or WINDOW_PASS):  # the ring pass: only its tiles with ring rows rotate
        _prefetch_rotation(rot_ptr + h * stride_rh, stride_rr, HEAD_DIM)
    if PREFETCH and HAS_FEEDBACK and WRITE_PAGES:
        _prefetch_f(fb_ptr + h * stride_fh, stride_fr, stride_fc, HEAD_DIM)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tokens
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    valid = tmask & (slot >= 0)
    Q4: tl.constexpr = HEAD_DIM // 4
    # whether this pass stores BF16 rows at all (an INT2-only pass reads no window bookkeeping)
    BF16_ROWS: tl.constexpr = (WRITE_SINK and SINK > 0) or (WRITE_RING and RECENT > 0)
    if BF16_ROWS:
        # positions and sequence indices exist for every token of the step (padding too): loaded
        # beside the slots, not behind them; the window slots and lengths they index only for real
        # tokens (a padding token's index may be stale)
        pos = tl.load(pos_ptr + t, mask=tmask, other=0)
        sidx = tl.load(seqidx_ptr + t, mask=tmask, other=0)
        ws = tl.load(wslot_ptr + sidx, mask=valid, other=0).to(tl.int64)
        # the BF16 rows this pass stores: its sink rows and / or its ring rows
        if WRITE_RING:
            length = tl.load(seqlen_ptr + sidx, mask=valid, other=0)
            ring_m = valid & (pos >= SINK) & (pos >= length - RECENT)
            bf16_m = ring_m
            if WRITE_SINK:
                bf16_m = bf16_m | (valid & (pos < SINK))
        else:
            bf16_m = valid & (pos < SINK)
        if not WRITE_PAGES and not WINDOW_PASS:  # the ring after a chunk: most tiles store nothing
            if tl.max(bf16_m.to(tl.int32), 0) == 0:
                return
    # the rows' loads: the window pass reads every token's row (a padding row is rotated, not stored)
    if WINDOW_PASS:
        xm = tmask
    else:
        xm = valid
    if HAS_ROPE:
        if WRITE_PAGES:
            # x0..x3 are the centred rows the INT2 part quantises
            rpos = tl.load(pos_ptr + t, mask=valid, other=0)
            x0, x1, x2, x3 = _centred_rotated_rows(
                x_ptr, stride_xt, stride_xh, rot_ptr, stride_rh, stride_rr, mean_ptr, stride_mh, rmean_ptr,
                stride_rmh, freq_ptr, rpos, t, h, valid, HEAD_DIM, HAS_MEAN, DOT_PRECISION,
            )  # fmt: skip
    else:
        x0, x1, x2, x3 = _rotate_rows(
            x_ptr, stride_xt, stride_xh, rot_ptr, stride_rh, stride_rr, mean_ptr, stride_mh, t, h, xm,
            HEAD_DIM, HAS_MEAN, DOT_PRECISION,
        )  # fmt: skip
    if WRITE_PAGES:
        if HAS_FEEDBACK:
            # program (pid, head) of this launch's grid: its own BLOCK_T x HEAD_DIM floats of scratch
            scr = scr_ptr + (pid * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * (BLOCK_T * HEAD_DIM)
            if PROBE:
                _stamp(probe_ptr, 1, tl.sum(tl.sum(x3, 1), 0))
            _stage(scr, x0, x1, x2, x3, BLOCK_T, Q4)
            # the feedback loop on FB_ROWS rows at a time, this program's real ones only: its cost
            # is its instructions, which scale with the elements a thread holds (a decode step's one
            # token a sequence no longer pays for the tile's padding rows)
            FBR: tl.constexpr = BLOCK_T if FB_ROWS == 0 else FB_ROWS
            rows = tl.minimum(n_tokens - pid * BLOCK_T, BLOCK_T)
            for r0 in range(0, rows, FBR):
                tc = pid * BLOCK_T + r0 + tl.arange(0, FBR)
                y0, y1, y2, y3 = _unstage(scr + r0 * Q4, BLOCK_T, FBR, Q4)
                if PROBE:
                    _stamp(probe_ptr, 2, tl.sum(tl.sum(y3, 1), 0))
                tcm = tc < n_tokens
                slot_c = tl.load(slot_ptr + tc, mask=tcm, other=-1).to(tl.int64)
                _int2_rows(
                    y0, y1, y2, y3, slot_c, tcm & (slot_c >= 0), h, alpha_ptr, fb_ptr + h * stride_fh,
                    stride_fr, stride_fc, codes_ptr, stride_cp, stride_ch, stride_ct, scale_ptr, zero_ptr,
                    stride_sp, stride_sh, stride_st, page_size, HEAD_DIM, GROUP, True, FB_ROWS != 0,
                    probe_ptr, PROBE,
                )  # fmt: skip
        else:
            _int2_rows(
                x0, x1, x2, x3, slot, valid, h, alpha_ptr, fb_ptr, stride_fr, stride_fc, codes_ptr,
                stride_cp, stride_ch, stride_ct, scale_ptr, zero_ptr, stride_sp, stride_sh, stride_st,
                page_size, HEAD_DIM, GROUP, False, False, probe_ptr, PROBE,
            )  # fmt: skip

    if BF16_ROWS:
        if HAS_ROPE:
            # the BF16 rows are not centred by RoPE_p(m): rotate the uncentred rows
            if WRITE_PAGES:
                if tl.max(bf16_m.to(tl.int32), 0) > 0:
                    x0, x1, x2, x3 = _rotate_rows(
                        x_ptr, stride_xt, stride_xh, rot_ptr, stride_rh, stride_rr, mean_ptr, stride_mh, t, h,
                        valid, HEAD_DIM, HAS_MEAN, DOT_PRECISION,
                    )  # fmt: skip
            else:  # a pass of BF16 rows only (the ring pass got here only with such a row in the block)
                x0, x1, x2, x3 = _rotate_rows(
                    x_ptr, stride_xt, stride_xh, rot_ptr, stride_rh, stride_rr, mean_ptr, stride_mh, t, h,
                    xm, HEAD_DIM, HAS_MEAN, DOT_PRECISION,
                )  # fmt: skip
        if WRITE_SINK and SINK > 0:
            m = valid & (pos < SINK)
            p = tl.where(m, pos, 0)
            _store_quarters(sink_ptr + ws * stride_ks + h * stride_kh + p * stride_kt, m, x0, x1, x2, x3, Q4)
        if WRITE_RING and RECENT > 0:
            p = tl.where(ring_m, pos % RECENT, 0)
            _store_quarters(
                ring_ptr + ws * stride_rs + h * stride_rgh + p * stride_rt, ring_m, x0, x1, x2, x3, Q4
            )
    if PROBE:
        _stamp(probe_ptr, 8, pid)


@triton.jit(do_not_specialize=["n_tokens"])
def paged_write_kv_kernel(
    k_ptr, stride_kxt, stride_kxh, v_ptr, stride_vxt, stride_vxh,
    krot_ptr, vrot_ptr, stride_rh, stride_rr,
    mean_ptr, stride_mh, rmean_ptr, stride_rmh, freq_ptr,
    kalpha_ptr, valpha_ptr,
    kfb_ptr, stride_kfh, stride_kfr, stride_kfc, vfb_ptr, stride_vfh, stride_vfr, stride_vfc,
    slot_ptr, pos_ptr, seqidx_ptr, seqlen_ptr, wslot_ptr,
    kcodes_ptr, vcodes_ptr, stride_cp, stride_ch, stride_ct,
    kscale_ptr, kzero_ptr, vscale_ptr, vzero_ptr, stride_sp, stride_sh, stride_st,
    ksink_ptr, vsink_ptr, stride_ks, stride_kh, stride_kt,
    kring_ptr, vring_ptr, stride_rs, stride_rgh, stride_rt,
    n_tokens, page_size, scr_ptr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, SINK: tl.constexpr,
    RECENT: tl.constexpr, HAS_MEAN: tl.constexpr, K_FEEDBACK: tl.constexpr, V_FEEDBACK: tl.constexpr,
    HAS_ROPE: tl.constexpr, WRITE_PAGES: tl.constexpr, WRITE_RING: tl.constexpr, WRITE_SINK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr, probe_ptr=None, PROBE: tl.constexpr = False, PREFETCH: tl.constexpr = False,
    FB_ROWS: tl.constexpr = 0, TRIGGER: tl.constexpr = False,
):  # fmt: skip
    """K and V in one launch: ``program_id(1)`` < ``NUM_KV_HEADS`` is a key head, the rest value heads.

    A decode step's write is latency, not bandwidth (a few tokens per KV head): one launch runs the
    K and V programs side by side instead of one after the other. The two caches share their
    layout, hence the strides; each tensor keeps its own constants (only keys have a mean or a
    pre-RoPE mean). ``TRIGGER`` (a decode step's window pass, sm_90+): a kernel launched after it
    as a programmatic dependent may start at once — the query rotation, which reads none of this
    kernel's output and waits for it before it ends (``rotate_rows_kernel``'s ``WAIT_END``)."""
    if TRIGGER:
        gdc_launch_dependents()
    if tl.program_id(1) < NUM_KV_HEADS:
        paged_write_kernel(
            k_ptr, stride_kxt, stride_kxh, krot_ptr, stride_rh, stride_rr, mean_ptr, stride_mh,
            rmean_ptr, stride_rmh, freq_ptr, kalpha_ptr, kfb_ptr, stride_kfh, stride_kfr, stride_kfc,
            slot_ptr, pos_ptr, seqidx_ptr, seqlen_ptr, wslot_ptr,
            kcodes_ptr, stride_cp, stride_ch, stride_ct,
            kscale_ptr, kzero_ptr, stride_sp, stride_sh, stride_st,
            ksink_ptr, stride_ks, stride_kh, stride_kt, kring_ptr, stride_rs, stride_rgh, stride_rt,
            n_tokens, page_size, scr_ptr, HEAD_DIM, GROUP, SINK, RECENT, HAS_MEAN, K_FEEDBACK, HAS_ROPE,
            WRITE_PAGES, WRITE_RING, WRITE_SINK, BLOCK_T, DOT_PRECISION, 0, probe_ptr, PROBE, PREFETCH,
            FB_ROWS,
        )  # fmt: skip
    else:
        paged_write_kernel(
            v_ptr, stride_vxt, stride_vxh, vrot_ptr, stride_rh, stride_rr, mean_ptr, stride_mh,
            rmean_ptr, stride_rmh, freq_ptr, valpha_ptr, vfb_ptr, stride_vfh, stride_vfr, stride_vfc,
            slot_ptr, pos_ptr, seqidx_ptr, seqlen_ptr, wslot_ptr,
            vcodes_ptr, stride_cp, stride_ch, stride_ct,
            vscale_ptr, vzero_ptr, stride_sp, stride_sh, stride_st,
            vsink_ptr, stride_ks, stride_kh, stride_kt, vring_ptr, stride_rs, stride_rgh, stride_rt,
            n_tokens, page_size, scr_ptr, HEAD_DIM, GROUP, SINK, RECENT, False, V_FEEDBACK, False,
            WRITE_PAGES, WRITE_RING, WRITE_SINK, BLOCK_T, DOT_PRECISION, NUM_KV_HEADS, probe_ptr, PROBE,
            PREFETCH, FB_ROWS,
        )  # fmt: skip
