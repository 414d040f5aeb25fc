"""``@triton.jit`` bodies of decode (split-K) and extend attention over the paged cache.

Everything runs in the rotated basis. A key/value row of ``d`` elements is handled as
four quarter-rows of ``Q4 = d/4`` elements, because the strided INT2 packing puts
elements ``b + i*d/4`` in bits ``2i`` of byte ``b``: one shift and mask of the
``[BLOCK_N, d/4]`` byte tile yields quarter ``i``, which is dotted with quarter ``i``
of the query. BF16 tiles use the same quarter form so every path shares the
accumulators ``acc0..acc3`` (``[M, Q4]`` float32).

With one quantisation group per row (``GROUP == HEAD_DIM``) the dequantisation is
folded out of the inner products: ``q·(c*s + z) = s*(q·c) + z*sum(q)`` and
``p·(c*s + z) = (p*s)·c + sum(p*z)``, so the tensor cores see raw codes.
``DOT`` is the dot operand dtype (bf16 on GPU, float32 in the interpreter).

The decode kernel for NVIDIA sm_80+ is in ``attention_gluon.py``; this one is the portable
path (any group size, other GPUs, the interpreter).
"""

from __future__ import annotations

import triton
import triton.language as tl

try:  # programmatic dependent launch (sm_90+): the decode op's three kernels overlap their edges
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: PDL=False everywhere (decode_attention.pdl_available)
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _softmax_step(s2, m_i, l_i):
    """Online softmax in the log2 domain; ``s2`` is ``-inf`` where masked."""
    m_new = tl.maximum(m_i, tl.max(s2, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s2 - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _codes(c, SHIFT: tl.constexpr, DOT: tl.constexpr, UNPACK: tl.constexpr):
    """``128 + ((c >> SHIFT) & 3)`` of a uint8 tile as dot operands (the 128 is folded out of the
    dot products by the callers).

    ``UNPACK`` selects how (both exact): 0 = PTX (GPU): four bytes per call — shift, mask and
    two ``prmt`` that put each 2-bit code under the bf16 exponent of 128 (``0x4300 | c`` =
    128 + c), about one integer op per element, no int→float conversion; 3 = the
    interpreter's float32 path (no inline PTX there). Other unpacks measured slower on the
    H200 (docs/performance.md) and were removed.
    """
    if UNPACK == 0:
        if SHIFT == 0:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; and.b32 t, $2, 0x03030303; "
                "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }",
                "=r,=r,r",
                [c],
                dtype=tl.bfloat16,
                is_pure=True,
                pack=4,
            )
        elif SHIFT == 2:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $2, 2; and.b32 t, t, 0x03030303; "
                "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }",
                "=r,=r,r",
                [c],
                dtype=tl.bfloat16,
                is_pure=True,
                pack=4,
            )
        elif SHIFT == 4:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $2, 4; and.b32 t, t, 0x03030303; "
                "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }",
                "=r,=r,r",
                [c],
                dtype=tl.bfloat16,
                is_pure=True,
                pack=4,
            )
        else:
            r = tl.inline_asm_elementwise(
                "{ .reg .b32 t; shr.b32 t, $2, 6; and.b32 t, t, 0x03030303; "
                "prmt.b32 $0, t, 0x43434343, 0x4140; prmt.b32 $1, t, 0x43434343, 0x4342; }",
                "=r,=r,r",
                [c],
                dtype=tl.bfloat16,
                is_pure=True,
                pack=4,
            )
    else:
        r = (((c >> SHIFT) & 3).to(tl.float32) + 128.0).to(DOT)
    return r


#: the constant :func:`_codes` adds to every code (folded out of the dot products)
CODE_OFFSET = tl.constexpr(128.0)


#: Cody-Waite split of 2π for the RoPE-mean score term: ``TWO_PI_HI`` has 8 significant bits
#: (201/32), so ``n·TWO_PI_HI`` is exact for ``n < 2^15`` (angles up to 2e5 rad)
#: (``tl.constexpr`` instances: Triton 3.6 kernels read no other globals)
TWO_PI_HI = tl.constexpr(6.28125)
TWO_PI_LO = tl.constexpr(0.0019353071795864769)  # 2π - TWO_PI_HI
INV_TWO_PI = tl.constexpr(0.15915494309189535)
#: bits of a float32 θ kept in ``θ_hi`` (sign, exponent, 6 mantissa bits): ``p·θ_hi`` is exact
#: for positions ``p < 2^17``
THETA_HI_MASK = tl.constexpr(-131072)


@triton.jit
def _theta_split(th):
    """``θ = θ_hi + θ_lo`` (float32, exact), ``θ_hi`` of 7 significant bits."""
    hi = (th.to(tl.int32, bitcast=True) & THETA_HI_MASK).to(tl.float32, bitcast=True)
    return hi, th - hi


@triton.jit
def _rope_angle(p, th_hi, th_lo):
    """``p·θ`` reduced by a multiple of ``2π`` (float32, ``|·| <= π + 1e-3``; broadcast shapes).

    ``p·θ_hi`` and ``n·TWO_PI_HI`` are exact and their difference is (nearly always) exact; what
    is left is the rounding of ``p·θ_lo`` (``|θ_lo| < 2^-6·θ``): at most 1.2e-4 rad for
    ``p·θ`` = 131071 (θ = 1), 4.8e-5 measured over 64 positions up to 131071 and the 64 θ of
    d = 128, where a plain float32 ``p·θ`` is off by 3.4e-3 rad. ``n`` is rounded from the whole
    sum, not from ``p·θ_hi`` alone: ``p·θ_lo`` reaches ~1e3 rad at such positions, and
    ``cos.approx.f32`` / ``sin.approx.f32`` (:func:`_rope_cos_sin`) hold their ~2^-21 on
    ``[-π, π]`` only. Plain ``*`` / ``+`` (the interpreter's numpy float32 gives the same); a
    compiler's fma contraction only makes it more exact.
    """
    a = p * th_hi
    b = p * th_lo
    n = ((a + b) * INV_TWO_PI + 0.5).to(tl.int32).to(tl.float32)  # round(p·θ / 2π): p, θ >= 0
    r = a - n * TWO_PI_HI
    r = r - n * TWO_PI_LO
    return r + b


@triton.jit
def _rope_slots(ROPE_P: tl.constexpr):
    """Slot ``i < 2·ROPE_P`` of the packed score term: pair ``i % ROPE_P``, its cosine half
    (``i < ROPE_P``) or its sine half. Cosines and sines share one ``K = 2·ROPE_P`` operand, so
    the term is 3 tensor-core dots, not 6 with ``K = ROPE_P`` (``tl.dot`` needs ``K >= 16``: 8
    pairs, the default artifact's, fill one operand exactly instead of two half-empty ones)."""
    i = tl.arange(0, 2 * ROPE_P)
    return i % ROPE_P, i < ROPE_P


@triton.jit
def _rope_basis(th_hi, th_lo, BLOCK_N: tl.constexpr, ROPE_P: tl.constexpr):
    """``cos(j·θ_r)`` (cosine slots) and ``sin(j·θ_r)`` (sine slots) ``[2·ROPE_P, BLOCK_N]`` for
    ``j < BLOCK_N`` (``θ`` per slot, :func:`_rope_load`), as a :func:`_bf16_split` pair: the
    loop-invariant half of :func:`_rope_scores`' angle addition, computed once per program."""
    _, cos_slot = _rope_slots(ROPE_P)
    jf = tl.arange(0, BLOCK_N).to(tl.float32)
    ang = _rope_angle(jf[None, :], th_hi[:, None], th_lo[:, None])
    return _bf16_split(tl.where(cos_slot[:, None], tl.cos(ang), tl.sin(ang)))


@triton.jit
def _rope_scores(rc0, rc1, th_hi, th_lo, basis, t0, acc, ROPE_P: tl.constexpr, DOT: tl.constexpr):
    """Score term ``[M, BLOCK_N]`` of INT2 keys at positions ``t0 + j`` (``j < BLOCK_N``):
    ``Σ_r C0[m, r]·cos((t0 + j)·θ_r) + C1[m, r]·sin((t0 + j)·θ_r)`` (``rc0/rc1 [M, 2·ROPE_P]``
    and ``θ [2·ROPE_P]`` per slot of :func:`_rope_load`).

    By angle addition, ``cos((t0 + j)θ) = cos(t0θ)cos(jθ) − sin(t0θ)sin(jθ)`` (and the sine), with
    the ``basis`` of :func:`_rope_basis`: the term is ``X @ basis`` where ``X [M, 2·ROPE_P]`` holds
    ``A = C0·cos(t0θ) + C1·sin(t0θ)`` in the cosine slots and ``B = C1·cos(t0θ) − C0·sin(t0θ)`` in
    the sine slots, so a tile evaluates ``2·ROPE_P`` cosines and sines instead of ``R·BLOCK_N`` of
    each (H200, 48 prefix hits over 100k tokens: the per-element form made the extend kernel ~3×
    slower than without the term). The product is three bf16 tensor-core dots of two-term splits
    (:func:`_bf16_split`: ``hi·hi + hi·lo + lo·hi``, ~2^-17 of the term's scale, the basis split
    once per program), added into ``acc`` (the tile's scores). History (H100/H200, 48 tails over
    100k INT2 tokens): float32 FMA loops made the extend kernel 2.65× slower with the term than
    without; ``tl.dot``'s ``tf32x3`` split both operands every tile and spilled 2,172 bytes a
    thread (1.9×); a spelled-out 3×TF32 (~2^-21) still cost 46 % of the kernel (48.3 against 26.0
    ms a layer, H100, 2026-12-07): TF32 runs at half bf16's rate, and the ``A`` operand, staged
    through shared memory every tile, is half the bytes in bf16. ~2^-17 is far below the
    INT2 keys' own error (units of ``q·k``, before the softmax scale). The angles as
    :func:`_rope_angle` (``t0θ`` exactly as ``(t0 + 0)θ`` was). Returns ``acc`` + the term."""
    c0, s0 = _rope_cos_sin(_rope_angle(th_hi * 0.0 + t0, th_hi, th_lo), DOT)  # [2P]
    c0 = c0[None, :]
    s0 = s0[None, :]
    _, cos_slot = _rope_slots(ROPE_P)
    ca = rc0 * c0 + rc1 * s0
    cb = rc1 * c0 - rc0 * s0
    x_hi, x_lo = _bf16_split(tl.where(cos_slot[None, :], ca, cb))
    y_hi, y_lo = basis
    # DOT: bf16 on a GPU (a no-op); float32 under the interpreter, whose bf16 dots are not exact
    x_hi, x_lo, y_hi, y_lo = x_hi.to(DOT), x_lo.to(DOT), y_hi.to(DOT), y_lo.to(DOT)
    t = tl.dot(x_lo, y_hi, acc)
    t = tl.dot(x_hi, y_lo, t)
    return tl.dot(x_hi, y_hi, t)


@triton.jit
def _rope_cos_sin(a, DOT: tl.constexpr):
    """``cos(a), sin(a)`` of angles reduced by :func:`_rope_angle` (``|a| <= π + 1e-3``):
    ``cos.approx.f32`` / ``sin.approx.f32`` on a GPU (abs. error ~2^-21 there), ``tl.cos`` /
    ``tl.sin`` under the interpreter (``DOT`` float32: no inline PTX there). libdevice's ``cosf`` /
    ``sinf`` put their slow path's 58 branches into the extend kernel's INT2 loop (offline sm_90
    PTX: the loop 3,687 lines with the term against 2,418 without) for every tile's ``2·ROPE_P``
    angles, which every thread holding a slot recomputes."""
    if DOT == tl.float32:
        return tl.cos(a), tl.sin(a)
    c = tl.inline_asm_elementwise(
        "cos.approx.f32 $0, $1;", "=r,r", [a], dtype=tl.float32, is_pure=True, pack=1
    )
    s = tl.inline_asm_elementwise(
        "sin.approx.f32 $0, $1;", "=r,r", [a], dtype=tl.float32, is_pure=True, pack=1
    )
    return c, s


@triton.jit
def _bf16_split(x):
    """``x ≈ hi + lo`` (bf16 each): ``hi`` = ``x`` rounded to bf16, ``lo`` the remainder rounded
    (``|x - hi - lo| <= 2^-18·|x|``), so ``hi·b_hi + hi·b_lo + lo·b_hi`` is the product to ~2^-17
    (the ``lo·lo`` term is below ``2^-18``)."""
    hi = x.to(tl.bfloat16)
    return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _rope_load(rc_ptr, crow, rmask, rth_ptr, ROPE_R: tl.constexpr, ROPE_P: tl.constexpr):
    """Coefficients ``C0, C1 [M, 2·ROPE_P]`` of rows ``crow`` (offsets of ``[2, ROPE_P]`` blocks)
    and the split ``θ [2·ROPE_P]``, per slot of :func:`_rope_slots` (each pair's values in its
    cosine and its sine slot; zero past ``ROPE_R``)."""
    r, _ = _rope_slots(ROPE_P)
    m2 = rmask[:, None]
    rc0 = tl.load(rc_ptr + crow[:, None] + r[None, :], mask=m2, other=0.0)
    rc1 = tl.load(rc_ptr + crow[:, None] + ROPE_P + r[None, :], mask=m2, other=0.0)
    th_hi, th_lo = _theta_split(tl.load(rth_ptr + r, mask=r < ROPE_R, other=0.0))
    return rc0, rc1, th_hi, th_lo


@triton.jit
def _int2_row_scores(q0, q1, q2, q3, qsum, kc, ks, kz, DOT: tl.constexpr, UNPACK: tl.constexpr):
    """Scores ``[M, BLOCK_N]`` of an INT2 key tile ``kc`` with one scale/zero per row (``ks, kz
    [BLOCK_N]``, any float dtype; ``GROUP == HEAD_DIM``)."""
    ks = ks.to(tl.float32)
    kz = kz.to(tl.float32)
    acc = tl.dot(q0, tl.trans(_codes(kc, 0, DOT, UNPACK)))
    acc = tl.dot(q1, tl.trans(_codes(kc, 2, DOT, UNPACK)), acc)
    acc = tl.dot(q2, tl.trans(_codes(kc, 4, DOT, UNPACK)), acc)
    acc = tl.dot(q3, tl.trans(_codes(kc, 6, DOT, UNPACK)), acc)
    # q·(s*c + z) = s*(q·(c+OFF)) + (z - OFF*s)*sum(q)
    return acc * ks[None, :] + qsum[:, None] * (kz - CODE_OFFSET * ks)[None, :]


@triton.jit
def _int2_row_pv(p, acc0, acc1, acc2, acc3, vc, vs, vz, DOT: tl.constexpr, UNPACK: tl.constexpr):
    """``acc_i += p @ dequant(vc)_i`` for an INT2 value tile ``vc`` with one scale/zero per row
    (``vs, vz [BLOCK_N]``; ``GROUP == HEAD_DIM``)."""
    vs = vs.to(tl.float32)
    vz = vz.to(tl.float32)
    pv = (p * vs[None, :]).to(DOT)
    # p·(s*c + z) = (p*s)·(c+OFF) + sum(p*z) - OFF*sum(p*s)   (sums of the rounded operand)
    corr = (tl.sum(p * vz[None, :], 1) - CODE_OFFSET * tl.sum(pv.to(tl.float32), 1))[:, None]
    acc0 = tl.dot(pv, _codes(vc, 0, DOT, UNPACK), acc0) + corr
    acc1 = tl.dot(pv, _codes(vc, 2, DOT, UNPACK), acc1) + corr
    acc2 = tl.dot(pv, _codes(vc, 4, DOT, UNPACK), acc2) + corr
    acc3 = tl.dot(pv, _codes(vc, 6, DOT, UNPACK), acc3) + corr
    return acc0, acc1, acc2, acc3


@triton.jit
def _int2_scores(
    q0,
    q1,
    q2,
    q3,
    qsum,
    kc,
    s_ptr,
    z_ptr,
    mrow,
    tmask,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT: tl.constexpr,
    UNPACK: tl.constexpr,
):
    """Scores ``[M, BLOCK_N]`` of queries against an INT2 key tile ``kc [BLOCK_N, Q4]``."""
    Q4: tl.constexpr = HEAD_DIM // 4
    if GROUP == HEAD_DIM:
        ks = tl.load(s_ptr + mrow, mask=tmask, other=0.0)
        kz = tl.load(z_ptr + mrow, mask=tmask, other=0.0)
        s = _int2_row_scores(q0, q1, q2, q3, qsum, kc, ks, kz, DOT, UNPACK)
    else:
        j = tl.arange(0, Q4)
        m2 = tmask[:, None]
        g = mrow[:, None] + (j[None, :] // GROUP)
        sc = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
        zc = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
        s = tl.dot(q0, tl.trans(((kc & 3).to(tl.float32) * sc + zc).to(DOT)))
        g = mrow[:, None] + ((j[None, :] + 1 * Q4) // GROUP)
        sc = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
        zc = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
        s = tl.dot(q1, tl.trans((((kc >> 2) & 3).to(tl.float32) * sc + zc).to(DOT)), s)
        g = mrow[:, None] + ((j[None, :] + 2 * Q4) // GROUP)
        sc = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
        zc = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
        s = tl.dot(q2, tl.trans((((kc >> 4) & 3).to(tl.float32) * sc + zc).to(DOT)), s)
        g = mrow[:, None] + ((j[None, :] + 3 * Q4) // GROUP)
        sc = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
        zc = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
        s = tl.dot(q3, tl.trans((((kc >> 6) & 3).to(tl.float32) * sc + zc).to(DOT)), s)
    return s


@triton.jit
def _int2_pv(
    p,
    acc0,
    acc1,
    acc2,
    acc3,
    vc,
    s_ptr,
    z_ptr,
    mrow,
    tmask,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT: tl.constexpr,
    UNPACK: tl.constexpr,
):
    """``acc_i += p @ dequant(vc)_i`` for an INT2 value tile ``vc [BLOCK_N, Q4]``."""
    Q4: tl.constexpr = HEAD_DIM // 4
    if GROUP == HEAD_DIM:
        vs = tl.load(s_ptr + mrow, mask=tmask, other=0.0)
        vz = tl.load(z_ptr + mrow, mask=tmask, other=0.0)
        acc0, acc1, acc2, acc3 = _int2_row_pv(p, acc0, acc1, acc2, acc3, vc, vs, vz, DOT, UNPACK)
    else:
        j = tl.arange(0, Q4)
        m2 = tmask[:, None]
        pd = p.to(DOT)
        g = mrow[:, None] + (j[None, :] // GROUP)
        sc = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
        zc = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
        acc0 = tl.dot(pd, ((vc & 3).to(tl.float32) * sc + zc).to(DOT), acc0)
        g = mrow[:, None] + ((j[None, :] + 1 * Q4) // GROUP)
        sc = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
        zc = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
        acc1 = tl.dot(pd, (((vc >> 2) & 3).to(tl.float32) * sc + zc).to(DOT), acc1)
        g = mrow[:, None] + ((j[None, :] + 2 * Q4) // GROUP)
        sc = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
        zc = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
        acc2 = tl.dot(pd, (((vc >> 4) & 3).to(tl.float32) * sc + zc).to(DOT), acc2)
        g = mrow[:, None] + ((j[None, :] + 3 * Q4) // GROUP)
        sc = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
        zc = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
        acc3 = tl.dot(pd, (((vc >> 6) & 3).to(tl.float32) * sc + zc).to(DOT), acc3)
    return acc0, acc1, acc2, acc3


@triton.jit
def _bf16_scores(q0, q1, q2, q3, k_ptr, row, tmask, Q4: tl.constexpr, DOT: tl.constexpr):
    """Scores against a 16-bit key tile whose rows start at ``k_ptr + row``."""
    j = tl.arange(0, Q4)
    ptr = k_ptr + row[:, None] + j[None, :]
    m2 = tmask[:, None]
    s = tl.dot(q0, tl.trans(tl.load(ptr, mask=m2, other=0.0).to(tl.float32).to(DOT)))
    s = tl.dot(q1, tl.trans(tl.load(ptr + Q4, mask=m2, other=0.0).to(tl.float32).to(DOT)), s)
    s = tl.dot(q2, tl.trans(tl.load(ptr + 2 * Q4, mask=m2, other=0.0).to(tl.float32).to(DOT)), s)
    s = tl.dot(q3, tl.trans(tl.load(ptr + 3 * Q4, mask=m2, other=0.0).to(tl.float32).to(DOT)), s)
    return s


@triton.jit
def _bf16_pv(
    p,
    acc0,
    acc1,
    acc2,
    acc3,
    v_ptr,
    row,
    tmask,
    Q4: tl.constexpr,
    DOT: tl.constexpr,
):
    j = tl.arange(0, Q4)
    ptr = v_ptr + row[:, None] + j[None, :]
    m2 = tmask[:, None]
    pd = p.to(DOT)
    acc0 = tl.dot(pd, tl.load(ptr, mask=m2, other=0.0).to(tl.float32).to(DOT), acc0)
    acc1 = tl.dot(pd, tl.load(ptr + Q4, mask=m2, other=0.0).to(tl.float32).to(DOT), acc1)
    acc2 = tl.dot(pd, tl.load(ptr + 2 * Q4, mask=m2, other=0.0).to(tl.float32).to(DOT), acc2)
    acc3 = tl.dot(pd, tl.load(ptr + 3 * Q4, mask=m2, other=0.0).to(tl.float32).to(DOT), acc3)
    return acc0, acc1, acc2, acc3


@triton.jit
def _bf16_range(
    q0,
    q1,
    q2,
    q3,
    m_i,
    l_i,
    acc0,
    acc1,
    acc2,
    acc3,
    base_k,
    base_v,
    lo,
    hi,
    ring,
    stride_row,
    sm_scale_log2,
    BLOCK_W: tl.constexpr,
    Q4: tl.constexpr,
    DOT: tl.constexpr,
):
    """Attend to bf16 rows ``(tok % ring) * stride_row`` for ``tok`` in ``[lo, hi)``."""
    for t0 in range(lo, hi, BLOCK_W):
        tok = t0 + tl.arange(0, BLOCK_W)
        tmask = tok < hi
        row = (tok % ring).to(tl.int64) * stride_row
        m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_tile(
            q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3, base_k, base_v, row, tmask, sm_scale_log2,
            Q4, DOT,
        )  # fmt: skip
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _bf16_tile(
    q0, q1, q2, q3, m_i, l_i, acc0, acc1, acc2, acc3, k_ptr, v_ptr, row, tmask, sm_scale_log2,
    Q4: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over 16-bit key/value rows starting at ``k_ptr/v_ptr + row``."""
    s = _bf16_scores(q0, q1, q2, q3, k_ptr, row, tmask, Q4, DOT)
    s2 = tl.where(tmask[None, :], s * sm_scale_log2, float("-inf"))
    p, alpha, m_i, l_i = _softmax_step(s2, m_i, l_i)
    acc0, acc1, acc2, acc3 = _rescale(acc0, acc1, acc2, acc3, alpha)
    acc0, acc1, acc2, acc3 = _bf16_pv(p, acc0, acc1, acc2, acc3, v_ptr, row, tmask, Q4, DOT)
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _rescale(acc0, acc1, acc2, acc3, alpha):
    """The accumulators' rows times the online softmax's correction ``alpha``."""
    return acc0 * alpha[:, None], acc1 * alpha[:, None], acc2 * alpha[:, None], acc3 * alpha[:, None]


@triton.jit
def _decode_program(H_KV: tl.constexpr, GQA: tl.constexpr, G_PAD: tl.constexpr):
    """A decode split program ``(b·H_kv + h, split)``: ``(b, h, split, row mask, query heads)`` of
    its ``GQA`` query heads (``G_PAD`` rows, the padding masked)."""
    pid = tl.program_id(0)
    rows = tl.arange(0, G_PAD)
    return pid // H_KV, pid % H_KV, tl.program_id(1), rows < GQA, (pid % H_KV) * GQA + rows


@triton.jit
def _page_rows(
    bt_row_ptr, tok, tmask, page_size, h, stride_cp, stride_ch, stride_ct, stride_sp, stride_sh, stride_st
):
    """Offsets of tokens ``tok`` of KV head ``h`` in the paged cache (block table row at
    ``bt_row_ptr``): ``(code row, scale/zero row)``."""
    page = tl.load(bt_row_ptr + tok // page_size, mask=tmask, other=0).to(tl.int64)
    off = tok % page_size
    return (
        page * stride_cp + h * stride_ch + off * stride_ct,
        page * stride_sp + h * stride_sh + off * stride_st,
    )


@triton.jit
def _row_meta(
    ks_ptr, kz_ptr, vs_ptr, vz_ptr, page, t0, hi, page_size, h, stride_sp, stride_sh, stride_st,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Key and value scales and zeros ``[BLOCK_N]`` (one per row) of the tile at ``t0`` in
    ``page``; rows at or past ``hi`` read as 0."""
    tok = t0 + tl.arange(0, BLOCK_N)
    mrow = page * stride_sp + h * stride_sh + (t0 % page_size + tl.arange(0, BLOCK_N)) * stride_st
    tm = tok < hi
    return (
        tl.load(ks_ptr + mrow, mask=tm, other=0.0),
        tl.load(kz_ptr + mrow, mask=tm, other=0.0),
        tl.load(vs_ptr + mrow, mask=tm, other=0.0),
        tl.load(vz_ptr + mrow, mask=tm, other=0.0),
    )


@triton.jit
def _int2_values(
    s2, m_i, l_i, acc0, acc1, acc2, acc3, v_row_ptr, vs_ptr, vz_ptr, mrow, tmask,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DOT: tl.constexpr, UNPACK: tl.constexpr,
):  # fmt: skip
    """The online softmax step of an INT2 tile with log2 scores ``s2`` (``-inf`` where masked)
    and its values: codes at ``v_row_ptr[:, None] + column``, scale/zero rows ``mrow``."""
    p, alpha, m_i, l_i = _softmax_step(s2, m_i, l_i)
    acc0, acc1, acc2, acc3 = _rescale(acc0, acc1, acc2, acc3, alpha)
    j = tl.arange(0, HEAD_DIM // 4)
    vc = tl.load(v_row_ptr[:, None] + j[None, :], mask=tmask[:, None], other=0)
    acc0, acc1, acc2, acc3 = _int2_pv(
        p, acc0, acc1, acc2, acc3, vc, vs_ptr, vz_ptr, mrow, tmask, GROUP, HEAD_DIM, DOT, UNPACK
    )
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _init_state(ROWS: tl.constexpr, Q4: tl.constexpr):
    """An empty online softmax for ``ROWS`` query rows: ``m``, ``l`` and four ``[ROWS, Q4]`` accumulators."""
    z = tl.zeros([ROWS, Q4], tl.float32)
    return tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32), z, z, z, z


@triton.jit
def _store_partial(po_ptr, plse_ptr, prow, rmask, m_i, l_i, acc0, acc1, acc2, acc3, HEAD_DIM: tl.constexpr):
    """A split's normalised partial output (row ``prow`` of ``po``, ``HEAD_DIM`` wide) and its
    log2-sum-exp; a split without keys stores only ``lse = -inf`` (the merges do not read its
    ``o``: most splits of a short sequence under a wide block table are empty)."""
    has = l_i > 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    _store_rows(po_ptr, prow.to(tl.int64) * HEAD_DIM, rmask & has, acc0, acc1, acc2, acc3, inv, HEAD_DIM // 4)
    tl.store(plse_ptr + prow, lse, mask=rmask)


@triton.jit
def _bf16_rows_causal(
    q0,
    q1,
    q2,
    q3,
    m_i,
    l_i,
    acc0,
    acc1,
    acc2,
    acc3,
    base_k,
    base_v,
    lo,
    hi,
    shift,
    ring,
    stride_row,
    qpos,
    sm_scale_log2,
    WINDOW: tl.constexpr,
    RECENT: tl.constexpr,
    BLOCK_W: tl.constexpr,
    Q4: tl.constexpr,
    DOT: tl.constexpr,
):
    """Attend to bf16 rows ``((tok + shift) % ring) * stride_row`` for ``tok`` in ``[lo, hi)``.

    Query row ``i`` (position ``qpos[i]``) reads ``tok <= qpos[i]``, and with ``WINDOW``
    only ``tok > qpos[i] - RECENT`` (the recent window; older keys are read as INT2).
    """
    for t0 in range(lo, hi, BLOCK_W):
        tok = t0 + tl.arange(0, BLOCK_W)
        tmask = tok < hi
        row = ((tok + shift) % ring).to(tl.int64) * stride_row
        s = _bf16_scores(q0, q1, q2, q3, base_k, row, tmask, Q4, DOT)
        ok = tmask[None, :] & (tok[None, :] <= qpos[:, None])
        if WINDOW:
            ok = ok & (tok[None, :] > qpos[:, None] - RECENT)
        s2 = tl.where(ok, s * sm_scale_log2, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(s2, m_i, l_i)
        acc0, acc1, acc2, acc3 = _rescale(acc0, acc1, acc2, acc3, alpha)
        acc0, acc1, acc2, acc3 = _bf16_pv(p, acc0, acc1, acc2, acc3, base_v, row, tmask, Q4, DOT)
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def _load_q(q_ptr, qrow, rmask, Q4: tl.constexpr, DOT: tl.constexpr):
    j = tl.arange(0, Q4)
    ptr = q_ptr + qrow[:, None] + j[None, :]
    m2 = rmask[:, None]
    q0 = tl.load(ptr, mask=m2, other=0.0).to(tl.float32)
    q1 = tl.load(ptr + Q4, mask=m2, other=0.0).to(tl.float32)
    q2 = tl.load(ptr + 2 * Q4, mask=m2, other=0.0).to(tl.float32)
    q3 = tl.load(ptr + 3 * Q4, mask=m2, other=0.0).to(tl.float32)
    qsum = tl.sum(q0, 1) + tl.sum(q1, 1) + tl.sum(q2, 1) + tl.sum(q3, 1)
    return q0.to(DOT), q1.to(DOT), q2.to(DOT), q3.to(DOT), qsum


@triton.jit
def _store_rows(o_ptr, orow, rmask, acc0, acc1, acc2, acc3, scale, Q4: tl.constexpr):
    j = tl.arange(0, Q4)
    ptr = o_ptr + orow[:, None] + j[None, :]
    m2 = rmask[:, None]
    tl.store(ptr, acc0 * scale[:, None], mask=m2)
    tl.store(ptr + Q4, acc1 * scale[:, None], mask=m2)
    tl.store(ptr + 2 * Q4, acc2 * scale[:, None], mask=m2)
    tl.store(ptr + 3 * Q4, acc3 * scale[:, None], mask=m2)


@triton.jit
def decode_split_kernel(
    q_ptr,
    stride_qb,
    stride_qh,
    kc_ptr,
    vc_ptr,
    stride_cp,
    stride_ch,
    stride_ct,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    stride_sp,
    stride_sh,
    stride_st,
    ksink_ptr,
    vsink_ptr,
    stride_ws0,
    stride_ws1,
    stride_ws2,
    kring_ptr,
    vring_ptr,
    stride_wr0,
    stride_wr1,
    stride_wr2,
    bt_ptr,
    stride_bt,
    seqlen_ptr,
    wslot_ptr,
    po_ptr,
    plse_ptr,
    sm_scale_log2,
    page_size,
    H_KV: tl.constexpr,
    GQA: tl.constexpr,
    G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    DOT: tl.constexpr,
    UNPACK: tl.constexpr,
    rc_ptr=None,
    rth_ptr=None,
    ROPE_R: tl.constexpr = 0,
    ROPE_P: tl.constexpr = 0,
):
    """Program ``(b*H_kv + h, split)``: all ``GQA`` query heads of KV head ``h``.

    Splits ``0..NUM_SPLITS-1`` cover equal page-aligned shares of the INT2 range
    ``[SINK, max(SINK, L - RECENT))``; split ``NUM_SPLITS`` the sink, split
    ``NUM_SPLITS + 1`` the recent ring. Each writes its normalised partial output
    and log2-sum-exp to ``po [B, H_q, NUM_SPLITS + 2, d]`` / ``plse``.
    ``ROPE_R > 0`` (pre-RoPE key mean): INT2 scores get :func:`_rope_scores` of the query rows'
    coefficients ``rc [B, H_q, 2, ROPE_P]`` and ``θ`` ``rth [ROPE_R]`` (0: today's kernel).
    """
    b, h, split, rmask, hq = _decode_program(H_KV, GQA, G_PAD)
    Q4: tl.constexpr = HEAD_DIM // 4
    NT: tl.constexpr = NUM_SPLITS + 2
    length = tl.load(seqlen_ptr + b)
    q0, q1, q2, q3, qsum = _load_q(q_ptr, b * stride_qb + hq * stride_qh, rmask, Q4, DOT)
    m_i, l_i, acc0, acc1, acc2, acc3 = _init_state(G_PAD, Q4)
    j = tl.arange(0, Q4)
    if split < NUM_SPLITS:
        start = SINK
        end = tl.maximum(length - RECENT, SINK)
        per = tl.cdiv(tl.cdiv(end - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = start + split * per
        hi = tl.minimum(end, lo + per)
        if ROPE_R > 0:
            rc0, rc1, th_hi, th_lo = _rope_load(
                rc_ptr, (b * (H_KV * GQA) + hq).to(tl.int64) * (2 * ROPE_P), rmask, rth_ptr, ROPE_R, ROPE_P
            )
            basis = _rope_basis(th_hi, th_lo, BLOCK_N, ROPE_P)
        for t0 in range(lo, hi, BLOCK_N):
            tok = t0 + tl.arange(0, BLOCK_N)
            tmask = tok < hi
            crow, mrow = _page_rows(
                bt_ptr + b * stride_bt, tok, tmask, page_size, h, stride_cp, stride_ch, stride_ct,
                stride_sp, stride_sh, stride_st,
            )  # fmt: skip
            kc = tl.load(kc_ptr + crow[:, None] + j[None, :], mask=tmask[:, None], other=0)
            s = _int2_scores(
                q0, q1, q2, q3, qsum, kc, ks_ptr, kz_ptr, mrow, tmask, GROUP, HEAD_DIM, DOT, UNPACK
            )
            if ROPE_R > 0:
                s = _rope_scores(rc0, rc1, th_hi, th_lo, basis, t0, s, ROPE_P, DOT)
            s2 = tl.where(tmask[None, :], s * sm_scale_log2, float("-inf"))
            m_i, l_i, acc0, acc1, acc2, acc3 = _int2_values(
                s2, m_i, l_i, acc0, acc1, acc2, acc3, vc_ptr + crow, vs_ptr, vz_ptr, mrow, tmask,
                GROUP, HEAD_DIM, DOT, UNPACK,
            )  # fmt: skip
    elif split == NUM_SPLITS:
        if SINK > 0:
            ws = tl.load(wslot_ptr + b).to(tl.int64)
            m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_range(
                q0,
                q1,
                q2,
                q3,
                m_i,
                l_i,
                acc0,
                acc1,
                acc2,
                acc3,
                ksink_ptr + ws * stride_ws0 + h * stride_ws1,
                vsink_ptr + ws * stride_ws0 + h * stride_ws1,
                0,
                tl.minimum(length, SINK),
                1 << 30,
                stride_ws2,
                sm_scale_log2,
                BLOCK_W,
                Q4,
                DOT,
            )
    else:
        if RECENT > 0:
            ws = tl.load(wslot_ptr + b).to(tl.int64)
            m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_range(
                q0,
                q1,
                q2,
                q3,
                m_i,
                l_i,
                acc0,
                acc1,
                acc2,
                acc3,
                kring_ptr + ws * stride_wr0 + h * stride_wr1,
                vring_ptr + ws * stride_wr0 + h * stride_wr1,
                tl.maximum(length - RECENT, SINK),
                length,
                RING,
                stride_wr2,
                sm_scale_log2,
                BLOCK_W,
                Q4,
                DOT,
            )
    prow = (b * (H_KV * GQA) + hq) * NT + split
    _store_partial(po_ptr, plse_ptr, prow, rmask, m_i, l_i, acc0, acc1, acc2, acc3, HEAD_DIM)


@triton.jit
def _rotate_store(x, rot_ptr, stride_ri, stride_rj, out_ptr, HEAD_DIM: tl.constexpr, RC: tl.constexpr):
    """``out[i] = Σ_j x[j]·rot[i*stride_ri + j*stride_rj]`` in float32, ``RC`` rows at a time
    (``x @ R``: strides of ``Rᵀ``; ``x @ Rᵀ``: strides of ``R``); stored in ``out``'s dtype."""
    j = tl.arange(0, HEAD_DIM)
    for i0 in tl.static_range(0, HEAD_DIM, RC):
        i = i0 + tl.arange(0, RC)
        r = tl.load(rot_ptr + i[:, None] * stride_ri + j[None, :] * stride_rj)
        _round_store(out_ptr + i, tl.sum(r * x[None, :], 1))


@triton.jit
def _round_store_masked(ptrs, y, mask):
    """Store float32 ``y`` in the pointers' dtype where ``mask`` holds (``None``: everywhere); bf16
    is rounded to nearest even by hand, since the interpreter truncates float32 → bf16."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        u = y.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        tl.store(ptrs, u.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _round_store(ptrs, y):
    """Store float32 ``y`` in the pointers' dtype (bf16: round to nearest even by hand, since
    the interpreter truncates float32 → bf16)."""
    _round_store_masked(ptrs, y, None)


@triton.jit
def rotate_rows_kernel(
    x_ptr, stride_xb, stride_xh, rot_ptr, stride_rh, stride_ri, stride_rj, out_ptr, HQ, GQA,
    HEAD_DIM: tl.constexpr, RC: tl.constexpr, PDL: tl.constexpr = False, ROWS: tl.constexpr = 0,
    rc_ptr=None, ab_ptr=None, pairs_ptr=None, ROPE_R: tl.constexpr = 0, ROPE_P: tl.constexpr = 0,
    WAIT_END: tl.constexpr = False,
):  # fmt: skip
    """Program ``(r = b*HQ + hq, c)``: row ``x[b, hq]`` times its KV head's rotation (float32
    FMAs, one launch instead of the three of ``rotate_queries``), output elements
    ``[c·ROWS, (c+1)·ROWS)`` (``ROWS`` 0: all, one program per row); ``out`` is ``[B, HQ, d]``
    contiguous. Several programs per row read a slice of the rotation each: one memory round
    trip instead of ``HEAD_DIM / RC`` chunks in one program (a short decode step waits for it).
    ``PDL``: lets the split kernel launch at once (it waits for this one before reading ``out``).
    ``ROPE_R > 0``: the first program of a row also writes the row's score coefficients of the
    pre-RoPE mean (``oscar_math.rope_center.rope_score_coef``) to ``rc [B, HQ, 2, ROPE_P]``
    (zero past ``ROPE_R``) from ``ab [H_kv, 2, ROPE_R]`` and ``pairs [ROPE_R]``: no extra launch.
    ``WAIT_END``: launched as a programmatic dependent of a decode step's window pass (which
    triggers at once: ``paged_write_kv_kernel``'s ``TRIGGER``), so the two run side by side — this
    kernel reads ``x`` only, written before that pass began — and waits for it before it ends:
    the split kernel, waiting for this one, then also finds the window rows written."""
    if PDL:
        gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    b = r // HQ
    hq = r % HQ
    x = tl.load(x_ptr + b * stride_xb + hq * stride_xh + tl.arange(0, HEAD_DIM)).to(tl.float32)
    rot = rot_ptr + (hq // GQA) * stride_rh
    if ROPE_R > 0:
        if tl.program_id(1) == 0:
            i = tl.arange(0, ROPE_P)
            im = i < ROPE_R
            pi = tl.load(pairs_ptr + i, mask=im, other=0)
            xrow = x_ptr + b * stride_xb + hq * stride_xh
            xa = tl.load(xrow + pi, mask=im, other=0.0).to(tl.float32)
            xb = tl.load(xrow + pi + HEAD_DIM // 2, mask=im, other=0.0).to(tl.float32)
            abr = ab_ptr + (hq // GQA) * (2 * ROPE_R)
            ca = tl.load(abr + i, mask=im, other=0.0)
            cb = tl.load(abr + ROPE_R + i, mask=im, other=0.0)
            tl.store(rc_ptr + r * (2 * ROPE_P) + i, xa * ca + xb * cb)
            tl.store(rc_ptr + r * (2 * ROPE_P) + ROPE_P + i, xb * ca - xa * cb)
    if ROWS == 0:
        _rotate_store(x, rot, stride_ri, stride_rj, out_ptr + r * HEAD_DIM, HEAD_DIM, RC)
    else:
        i = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        j = tl.arange(0, HEAD_DIM)
        rr = tl.load(rot + i[:, None] * stride_ri + j[None, :] * stride_rj)
        _round_store(out_ptr + r * HEAD_DIM + i, tl.sum(rr * x[None, :], 1))
    if WAIT_END:
        gdc_wait()


@triton.jit
def merge_splits_kernel(
    po_ptr, plse_ptr, out_ptr, rot_ptr, stride_rh, stride_ri, stride_rj, NT, HQ, GQA,
    HEAD_DIM: tl.constexpr, CH: tl.constexpr, ROTATE: tl.constexpr, RC: tl.constexpr,
    PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False,
):  # fmt: skip
    """Program ``r`` (one query head of one sequence): LSE-merge ``NT`` partials, ``CH`` at a
    time (any split count without holding ``[NT, d]`` in registers); with ``ROTATE`` the
    merged row is un-rotated here (``o @ R_Vᵀ``) and stored in ``out``'s dtype.

    One pass with an online max (a chunk's ``lse`` and ``o`` are loaded together, so a chunk
    costs one memory round trip): the merge of 133 partials was two passes of 5 serial
    chunks, ~10 dependent loads, a visible share of a short-context decode step.
    ``PDL``: launched as a programmatic dependent of the split kernel; waits for it here.
    ``PRELOAD`` (with ``ROTATE``): the whole ``[d, d]`` rotation is loaded before that wait
    (it does not depend on the split kernel), so only the partials are read after it."""
    r = tl.program_id(0).to(tl.int64)
    if ROTATE and PRELOAD:
        ri = tl.arange(0, HEAD_DIM)
        rrot = tl.load(
            rot_ptr + ((r % HQ) // GQA) * stride_rh + ri[:, None] * stride_ri + ri[None, :] * stride_rj
        )
    if PDL:
        gdc_wait()
    s = tl.arange(0, CH)
    d = tl.arange(0, HEAD_DIM)
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, NT, CH):
        sm = s0 + s < NT
        prow = r * NT + s0 + s
        lse = tl.load(plse_ptr + prow, mask=sm, other=float("-inf"))
        o = tl.load(po_ptr + prow[:, None] * HEAD_DIM + d[None, :], mask=sm[:, None], other=0.0)
        live = lse > float("-inf")  # an empty partial's o is never written (any bits): zeroed
        o = tl.where(live[:, None], o, 0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)  # 0 on the first non-empty chunk (m = -inf)
        w = tl.exp2(lse - m_safe)  # empty partials (lse = -inf) weigh 0
        den = den * alpha + tl.sum(w, 0)
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        m = m_new
    out = acc / tl.where(den > 0, den, 1.0)
    if ROTATE and PRELOAD:
        _round_store(out_ptr + r * HEAD_DIM + d, tl.sum(rrot * out[None, :], 1))
    elif ROTATE:
        rot = rot_ptr + ((r % HQ) // GQA) * stride_rh
        _rotate_store(out, rot, stride_ri, stride_rj, out_ptr + r * HEAD_DIM, HEAD_DIM, RC)
    else:
        tl.store(out_ptr + r * HEAD_DIM + d, out)


@triton.jit
def merge_cols_kernel(
    po_ptr, plse_ptr, out_ptr, NT,
    HEAD_DIM: tl.constexpr, DC: tl.constexpr, CH: tl.constexpr,
    PDL: tl.constexpr = False, DEPENDENTS: tl.constexpr = False,
):  # fmt: skip
    """Program ``(r, c)`` (one query head of one sequence, output columns ``[c·DC, (c+1)·DC)``):
    LSE-merge of the row's ``NT`` partials on that column slice, ``CH`` partials a step (one
    step for ``NT <= CH``: every decode split count but batch 1's at long contexts), stored in
    ``out``'s dtype (``[B·H_q, d]`` contiguous). The merge of ``merge_partials`` (``v2``): ``d /
    DC`` programs a row instead of one, each reading ``NT × DC`` partials (one memory round trip)
    instead of ``NT × d`` in ``NT / 64`` dependent steps; the un-rotation is
    ``unrotate_rows_kernel``'s. Every column slice recomputes the row's max and denominator from
    ``plse`` (``NT`` floats). ``PDL``: waits for the split kernel before reading the partials;
    ``DEPENDENTS``: lets the un-rotation kernel launch at once (it waits for this one)."""
    if DEPENDENTS:
        gdc_launch_dependents()
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * DC + tl.arange(0, DC)
    if PDL:
        gdc_wait()
    s = tl.arange(0, CH)
    mx = tl.full([], float("-inf"), tl.float32)
    l_sum = tl.zeros([], tl.float32)
    acc = tl.zeros([DC], tl.float32)
    for s0 in range(0, NT, CH):  # one step where NT <= CH
        inr = s0 + s < NT
        prow = r * NT + s0 + s
        # o is loaded beside lse, not behind it (one memory round trip a step, not two); an empty
        # partial's o is never written (any bits, NaN too): its rows are zeroed, never used
        lse = tl.load(plse_ptr + prow, mask=inr, other=float("-inf"))
        o = tl.load(po_ptr + prow[:, None] * HEAD_DIM + cols[None, :], mask=inr[:, None], other=0.0)
        live = lse > float("-inf")
        o = tl.where(live[:, None], o, 0.0)
        mx_new = tl.maximum(mx, tl.max(lse, 0))
        sub = tl.where(mx_new == float("-inf"), 0.0, mx_new)  # the max subtracted (0 while all empty)
        a = tl.exp2(mx - sub)  # rescales the steps before; 0 on the first non-empty one
        w = tl.exp2(lse - sub)  # empty partials (lse = -inf) weigh 0
        l_sum = l_sum * a + tl.sum(w, 0)
        acc = acc * a + tl.sum(w[:, None] * o, 0)
        mx = mx_new
    _round_store(out_ptr + r * HEAD_DIM + cols, acc / tl.where(l_sum > 0, l_sum, 1.0))


@triton.jit
def unrotate_rows_kernel(
    o_ptr, rot_ptr, stride_rh, stride_ri, stride_rj, out_ptr, ROWS, HQ, GQA,
    HEAD_DIM: tl.constexpr, BM: tl.constexpr, OC: tl.constexpr, KC: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Program ``(h, c, mb)``: ``out[r, cols] = o[r] @ R_h[cols, :]ᵀ`` for the query rows ``r`` of
    KV head ``h`` (``ROWS = B·GQA`` of them, ``BM`` a program) and the output columns ``cols =
    [c·OC, (c+1)·OC)``, stored in ``out``'s dtype; ``o``, ``out``: ``[B·H_q, d]`` contiguous,
    ``R_h`` at ``rot + h·stride_rh`` (``R[i, j]`` at ``i·stride_ri + j·stride_rj``). A ``[OC, d]``
    slice of ``R_h`` serves ``BM`` rows of the KV head's GQA group and batch: ``R_V`` is read
    ``⌈B·GQA / BM⌉`` times a layer instead of ``B·H_q`` times (16 MB at batch 8, d 128).

    Float32 FMAs: ``tl.dot`` with IEEE float32 inputs (no tensor-core tf32 rounding), ``KC`` of the
    ``d`` terms a step (one ``[BM, d] x [d, OC]`` FMA dot holds whole operand rows per thread: 255
    registers and spills at 16 x 16 x 128 for sm_90; ``KC`` 32: 43, no spills). All loads are
    issued after the ``PDL`` wait (a programmatic dependent of ``merge_cols_kernel``): ``R`` and
    ``o`` arrive in one round trip (``R``'s slice is 8 KB; loading it before the wait would hold
    it across the wait for no gain in latency)."""
    if PDL:
        gdc_wait()
    h = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * OC + tl.arange(0, OC)
    m = tl.program_id(2) * BM + tl.arange(0, BM)
    rm = m < ROWS
    row = (m // GQA).to(tl.int64) * HQ + h * GQA + m % GQA
    k = tl.arange(0, KC)
    acc = tl.zeros([BM, OC], tl.float32)
    for k0 in tl.static_range(0, HEAD_DIM, KC):
        o = tl.load(
            o_ptr + row[:, None] * HEAD_DIM + k0 + k[None, :], mask=rm[:, None], other=0.0
        )  # [BM, KC]
        rt = rot_ptr + h * stride_rh + cols[None, :] * stride_ri + (k0 + k)[:, None] * stride_rj
        acc = tl.dot(o, tl.load(rt), acc, input_precision="ieee")  # [KC, OC]: R[cols, k]ᵀ
    _round_store_masked(out_ptr + row[:, None] * HEAD_DIM + cols[None, :], acc, rm[:, None])


# a run-time count: one compile serves every split count; the per-sequence tensors are views at a
# step's row offset (any address): one compile for every offset (scalar and gathered loads only)
@triton.jit(
    do_not_specialize=["splits"],
    do_not_specialize_on_alignment=["bt_ptr", "cu_ptr", "prefix_ptr", "wslot_ptr"],
)
def extend_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    kn_ptr,
    vn_ptr,
    stride_nt,
    stride_nh,
    kc_ptr,
    vc_ptr,
    stride_cp,
    stride_ch,
    stride_ct,
    ks_ptr,
    kz_ptr,
    vs_ptr,
    vz_ptr,
    stride_sp,
    stride_sh,
    stride_st,
    ksink_ptr,
    vsink_ptr,
    stride_ws0,
    stride_ws1,
    stride_ws2,
    kring_ptr,
    vring_ptr,
    stride_wr0,
    stride_wr1,
    stride_wr2,
    bt_ptr,
    stride_bt,
    cu_ptr,
    prefix_ptr,
    wslot_ptr,
    o_ptr,
    stride_ot,
    stride_oh,
    sm_scale_log2,
    page_size,
    H_Q: tl.constexpr,
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    SINK: tl.constexpr,
    RECENT: tl.constexpr,
    RING: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT: tl.constexpr,
    UNPACK: tl.constexpr,
    rc_ptr=None,
    rth_ptr=None,
    ROPE_R: tl.constexpr = 0,
    ROPE_P: tl.constexpr = 0,
    po_ptr=None,
    plse_ptr=None,
    splits=1,
    SPLIT: tl.constexpr = False,
    PAGE_TILES: tl.constexpr = False,
):
    """Program ``(token block, b*H_kv + h[, split])``: ``BLOCK_M`` rows, row ``r`` the query head
    ``h·GQA + r % GQA`` of chunk token ``block·BLOCK_T + r // GQA`` (``BLOCK_T = BLOCK_M // GQA``).

    Per query token ``t`` (``P`` the prefix, ``L = P + chunk``): key ``j <= t`` is read as
    the INT2 row iff ``SINK <= j <= t - RECENT``, else in BF16 — the sink row for
    ``j < SINK``, the ring row for a prefix key, the chunk's own rotated key otherwise.
    The caller has written the chunk's INT2 rows and sink rows (``paged_write`` parts
    ``"pages"``) but not yet its ring rows. For the block's queries ``[t_lo, t_hi)``:

    * sink ``[0, min(SINK, t_hi))``, causal;
    * INT2 ``[SINK, t_hi - RECENT)`` (prefix and chunk), masked to ``j <= t - RECENT``;
    * ring ``[max(SINK, t_lo - RECENT + 1), P)`` and chunk ``[max(SINK, P, ...), t_hi)``,
      masked to ``t - RECENT < j <= t``.

    Keys in the ``BLOCK_T - 1`` positions where the two rules meet are visited twice,
    once per copy, each query taking exactly one. INT2 tiles are dequantised in
    registers; nothing is materialised. ``ROPE_R > 0``: INT2 scores get the pre-RoPE mean's
    term (:func:`_rope_scores`; coefficients ``rc [T, H_q, 2, ROPE_P]`` per query token).

    ``SPLIT`` (a short chunk over a long prefix: too few programs otherwise): split ``s`` of
    ``program_id(2)``, one of ``splits`` (a run-time count), takes its share of the INT2 tiles (the
    same tiles, from ``SINK`` in steps of ``BLOCK_N``), split 0 also the BF16 rows, and each stores
    its normalised partial and log2-sum-exp at row ``(token·H_q + hq)·splits + s`` of ``po`` /
    ``plse`` for ``merge_splits_kernel``.

    ``PAGE_TILES`` (the caller's promise: ``page_size`` and ``SINK`` multiples of ``BLOCK_N``, so
    every INT2 tile lies in one page): a tile's page is one scalar load, made two tiles ahead, and
    with one scale/zero per row (``GROUP == HEAD_DIM``) its scales and zeros are loaded a tile
    ahead.
    """
    mb = tl.program_id(0)
    pid = tl.program_id(1)
    H_KV: tl.constexpr = H_Q // GQA
    # rows are (token, query head) pairs of one KV head: a KV tile is dequantised once for its GQA
    # query heads, and a short chunk (a prefix hit's tail, a decode in a mixed batch) still fills
    # the dot's M dimension
    BLOCK_T: tl.constexpr = BLOCK_M // GQA
    b = pid // H_KV
    h = pid % H_KV
    Q4: tl.constexpr = HEAD_DIM // 4
    qs = tl.load(cu_ptr + b)
    qlen = tl.load(cu_ptr + b + 1) - qs
    if mb * BLOCK_T < qlen:
        prefix = tl.load(prefix_ptr + b)
        total = prefix + qlen
        ws = tl.load(wslot_ptr + b).to(tl.int64)
        r = tl.arange(0, BLOCK_M)
        hq = h * GQA + r % GQA
        m = mb * BLOCK_T + r // GQA
        mmask = (r < BLOCK_T * GQA) & (m < qlen)
        qpos = prefix + m
        t_lo = prefix + mb * BLOCK_T
        t_hi = tl.minimum(total, t_lo + BLOCK_T)
        qrow = (qs + m).to(tl.int64) * stride_qt + hq * stride_qh
        q0, q1, q2, q3, qsum = _load_q(q_ptr, qrow, mmask, Q4, DOT)
        m_i, l_i, acc0, acc1, acc2, acc3 = _init_state(BLOCK_M, Q4)
        j = tl.arange(0, Q4)
        sp = tl.program_id(2) if SPLIT else 0
        bf16 = sp == 0  # the BF16 rows: one split's share
        # sink rows (the chunk's own sink positions were written before this call)
        if SINK > 0:
            if bf16:
                m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_rows_causal(
                    q0,
                    q1,
                    q2,
                    q3,
                    m_i,
                    l_i,
                    acc0,
                    acc1,
                    acc2,
                    acc3,
                    ksink_ptr + ws * stride_ws0 + h * stride_ws1,
                    vsink_ptr + ws * stride_ws0 + h * stride_ws1,
                    0,
                    tl.minimum(t_hi, SINK),
                    0,
                    1 << 30,
                    stride_ws2,
                    qpos,
                    sm_scale_log2,
                    False,
                    RECENT,
                    BLOCK_N,
                    Q4,
                    DOT,
                )
        # INT2 rows: j <= t - RECENT, prefix and chunk alike
        hi = t_hi - RECENT
        if ROPE_R > 0:
            rc0, rc1, th_hi, th_lo = _rope_load(
                rc_ptr, ((qs + m).to(tl.int64) * H_Q + hq) * (2 * ROPE_P), mmask, rth_ptr, ROPE_R, ROPE_P
            )
            basis = _rope_basis(th_hi, th_lo, BLOCK_N, ROPE_P)
        i0 = SINK
        i1 = hi
        if SPLIT:  # this split's share of the INT2 tiles
            per = tl.cdiv(tl.cdiv(tl.maximum(hi - SINK, 0), BLOCK_N), splits) * BLOCK_N
            i0 = SINK + sp * per
            i1 = tl.minimum(hi, i0 + per)
        bt_row = bt_ptr + b * stride_bt
        # PAGE_TILES: `page` is the tile's page (a scalar loaded a tile before), `nxt` the next
        # tile's; with one scale/zero per row the tile's scales and zeros were loaded a tile before
        # too (ROWS_AHEAD): a tile's plain loads were its block-table entries, then its scales and
        # zeros, each waited for in turn inside the pipelined loop (only the code tiles are
        # asynchronous copies)
        ROWS_AHEAD: tl.constexpr = PAGE_TILES and GROUP == HEAD_DIM
        if PAGE_TILES:
            page = tl.load(bt_row + i0 // page_size, mask=i0 < i1, other=0).to(tl.int64)
            nxt = tl.load(bt_row + (i0 + BLOCK_N) // page_size, mask=i0 + BLOCK_N < i1, other=0)
            if ROWS_AHEAD:
                ks_n, kz_n, vs_n, vz_n = _row_meta(
                    ks_ptr, kz_ptr, vs_ptr, vz_ptr, page, i0, hi, page_size, h, stride_sp, stride_sh,
                    stride_st, BLOCK_N,
                )  # fmt: skip
        for t0 in range(i0, i1, BLOCK_N):
            tok = t0 + tl.arange(0, BLOCK_N)
            tmask = tok < hi
            if PAGE_TILES:
                off = t0 % page_size + tl.arange(0, BLOCK_N)
                crow = page * stride_cp + h * stride_ch + off * stride_ct
                mrow = page * stride_sp + h * stride_sh + off * stride_st
                page = nxt.to(tl.int64)
                if ROWS_AHEAD:
                    ks, kz, vs, vz = ks_n, kz_n, vs_n, vz_n
                    ks_n, kz_n, vs_n, vz_n = _row_meta(
                        ks_ptr, kz_ptr, vs_ptr, vz_ptr, page, t0 + BLOCK_N, hi, page_size, h, stride_sp,
                        stride_sh, stride_st, BLOCK_N,
                    )  # fmt: skip
                ahead = t0 + 2 * BLOCK_N
                nxt = tl.load(bt_row + ahead // page_size, mask=ahead < i1, other=0)
            else:
                crow, mrow = _page_rows(
                    bt_row, tok, tmask, page_size, h, stride_cp, stride_ch, stride_ct, stride_sp,
                    stride_sh, stride_st,
                )  # fmt: skip
            kc = tl.load(kc_ptr + crow[:, None] + j[None, :], mask=tmask[:, None], other=0)
            if ROWS_AHEAD:
                s = _int2_row_scores(q0, q1, q2, q3, qsum, kc, ks, kz, DOT, UNPACK)
            else:
                s = _int2_scores(
                    q0, q1, q2, q3, qsum, kc, ks_ptr, kz_ptr, mrow, tmask, GROUP, HEAD_DIM, DOT, UNPACK
                )
            if ROPE_R > 0:
                s = _rope_scores(rc0, rc1, th_hi, th_lo, basis, t0, s, ROPE_P, DOT)
            ok = tmask[None, :] & (tok[None, :] <= qpos[:, None] - RECENT)
            s2 = tl.where(ok, s * sm_scale_log2, float("-inf"))
            if ROWS_AHEAD:
                p, alpha, m_i, l_i = _softmax_step(s2, m_i, l_i)
                acc0, acc1, acc2, acc3 = _rescale(acc0, acc1, acc2, acc3, alpha)
                vc = tl.load(vc_ptr + crow[:, None] + j[None, :], mask=tmask[:, None], other=0)
                acc0, acc1, acc2, acc3 = _int2_row_pv(p, acc0, acc1, acc2, acc3, vc, vs, vz, DOT, UNPACK)
            else:
                m_i, l_i, acc0, acc1, acc2, acc3 = _int2_values(
                    s2, m_i, l_i, acc0, acc1, acc2, acc3, vc_ptr + crow, vs_ptr, vz_ptr, mrow, tmask,
                    GROUP, HEAD_DIM, DOT, UNPACK,
                )  # fmt: skip
        if RECENT > 0:
            if bf16:
                # the oldest key any query of the block reads in BF16
                w0 = tl.maximum(t_lo - RECENT + 1, SINK)
                # recent ring: prefix keys (the chunk's ring rows are written after this call)
                m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_rows_causal(
                    q0,
                    q1,
                    q2,
                    q3,
                    m_i,
                    l_i,
                    acc0,
                    acc1,
                    acc2,
                    acc3,
                    kring_ptr + ws * stride_wr0 + h * stride_wr1,
                    vring_ptr + ws * stride_wr0 + h * stride_wr1,
                    w0,
                    tl.minimum(prefix, t_hi),
                    0,
                    RING,
                    stride_wr2,
                    qpos,
                    sm_scale_log2,
                    True,
                    RECENT,
                    BLOCK_N,
                    Q4,
                    DOT,
                )
                # the chunk's own keys, rotated bf16, causally
                m_i, l_i, acc0, acc1, acc2, acc3 = _bf16_rows_causal(
                    q0,
                    q1,
                    q2,
                    q3,
                    m_i,
                    l_i,
                    acc0,
                    acc1,
                    acc2,
                    acc3,
                    kn_ptr + h * stride_nh,
                    vn_ptr + h * stride_nh,
                    tl.maximum(w0, prefix),
                    t_hi,
                    qs - prefix,
                    1 << 30,
                    stride_nt,
                    qpos,
                    sm_scale_log2,
                    True,
                    RECENT,
                    BLOCK_N,
                    Q4,
                    DOT,
                )
        if SPLIT:
            prow = ((qs + m).to(tl.int64) * H_Q + hq) * splits + sp
            _store_partial(po_ptr, plse_ptr, prow, mmask, m_i, l_i, acc0, acc1, acc2, acc3, HEAD_DIM)
        else:
            inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
            orow = (qs + m).to(tl.int64) * stride_ot + hq * stride_oh
            _store_rows(o_ptr, orow, mmask, acc0, acc1, acc2, acc3, inv, Q4)
