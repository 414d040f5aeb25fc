"""Decode split kernel in Triton's Gluon dialect: INT2 codes straight into ``mma`` fragments.

Same contract as ``decode_split_kernel`` in ``attention.py`` (same operands, same partial
outputs ``po`` / ``plse``, same split scheme), for NVIDIA sm_80+ and ``GROUP == HEAD_DIM``
with ``HEAD_DIM % 64 == 0``. What differs is how a tile reaches the tensor cores:

* Tokens are the M side of every ``mma.sync m16n8k16``: scores are computed transposed,
  ``sᵀ[BLOCK_N, NP] = codes_k[BLOCK_N, d/4] @ q'ᵀ[d/4, NP]`` per quarter, and the output
  as ``oᵀ[d/4, NP] += codes_vᵀ[d/4, BLOCK_N] @ p[BLOCK_N, NP]``, so the GQA group is
  padded to ``NP = max(8, next_pow2(GQA))`` columns instead of 16 rows.
* Code tiles are loaded from global memory directly in the ``mma`` A-operand register
  layout (``DotOperandLayout``, ``k_width`` 8: eight consecutive key bytes per thread, one
  64-bit load), so the unpacked operand never goes through shared memory.
* Unpack: one ``and`` per two codes (keys: plus one shift per word shared by the four
  quarters; values: plus one ``prmt`` per two tokens and quarter), no int→float
  conversion. Quarter ``j`` lives in bits ``2j`` of each byte; the masked 16-bit half
  ``c·4^j`` *is* an fp16 number, a subnormal: ``x = c·4^j·2^-24`` exactly (fp16 has 10
  mantissa bits, ``c·4^j ≤ 192``), and the tensor cores take fp16 subnormals as they are.
  ``2·4^-j`` is folded into the query (keys: every quarter's product is then
  ``c·q·2^-23``, one accumulator for all four) and ``2^24·4^-j`` into the final output
  (values); ``2^23`` into the softmax scale. Each ``and`` takes its mask as the one
  immediate operand: the former ``(w & mask) | 0x60006000`` (fp16 ``512 + c·4^j/2``) needed
  a second constant, which ptxas re-materialised with a ``mov`` before ~every ``lop3``
  (856 → 702 SASS instructions per 32-token tile, Triton 3.9), and an offset of 512 per code that had
  to be removed again (per tile for values: ``mma.sync`` accumulates fp32 with truncation,
  and a split-long offset biased quarter 0 by 1e-2 … 1e-1, docs/performance.md).
* Scale and zero are applied per token outside the dot:
  ``q·(s·c + z) = s·(q'·x)·2^23 + z·Σq`` and ``Σ_t p_t(s_t·c_t + z_t)`` from
  ``acc = Σ (p·s)·x`` and ``Σ p·z`` (both rescaled by the online softmax), so the
  tensor cores see raw codes.
* The next tile's codes, scales and page ids are loaded before the current tile is
  computed (register double buffering: one tile always in flight per warp).
* The BF16 sink/ring windows run in the same layouts (bf16 ``mma``, tiles loaded straight
  into A-operand registers), in extra programs of 32 window tokens each per (sequence, KV
  head) (:func:`window_programs`: 10 for the default 64 + 256).
* ``ASYNC`` (chosen per launch by ``decode_attention.async_ring_mode``: splits of >= 16
  tiles): the INT2 tiles go through a ``cp.async`` ring of ``ASYNC`` shared-memory stages
  instead of the register prefetch (ptxas issues the latter's loads late in the iteration);
  ``ASYNC_WIDE``: 16-byte copies in their own layout (128 registers at 32-token tiles,
  faster only where the grid fills 16 programs per SM), else the compute layouts' 4-8 bytes
  (168 registers). 56 % of copy bandwidth at 128k x 8 with 64-token tiles and 16-byte
  copies vs 48 % with the register prefetch (docs/performance.md).
* ``PDL`` (sm_90, programmatic dependent launch): the kernel lets the merge launch at once
  and waits for the query-rotation kernel only just before it loads the rotated queries.

Requires ``triton.experimental.gluon`` (Triton >= 3.6); :data:`GLUON_IMPORT_ERROR` says why
it is unavailable otherwise.
"""

from __future__ import annotations

GLUON_IMPORT_ERROR: str | None = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as _acp
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    # cp.async global -> shared: ``async_copy_global_to_shared`` in Triton 3.6, ``async_load`` in 3.9
    _cp_async = getattr(_acp, "async_load", None) or _acp.async_copy_global_to_shared
except Exception as e:  # noqa: BLE001 - any import problem means "no Gluon"
    GLUON_IMPORT_ERROR = f"{type(e).__name__}: {e}"
    gluon = None

#: value of the unpacked fp16 operand per unit of ``c·4^j`` (a subnormal: ``2^-24``)
UNPACK_UNIT = 2.0**-24

#: BF16 window tokens per program (sink and recent windows are cut into pieces this long): one
#: 32-token tile each, so no program walks the window tiles serially (64 → 32 at 8k x 1:
#: docs/performance.md)
WINDOW_TOKENS_PER_PROGRAM = 32


def window_programs(sink: int, recent: int, w_tok: int = WINDOW_TOKENS_PER_PROGRAM) -> int:
    """Programs per (sequence, KV head) after the INT2 splits: the windows in ``w_tok`` pieces."""
    return -(-sink // w_tok) + -(-recent // w_tok)


if gluon is not None:

    @gluon.jit
    def _unpack_k(w, MASK: gl.constexpr, BLOCK_N: gl.constexpr, Q4: gl.constexpr, LA: gl.constexpr):
        """Key words ``[BLOCK_N, Q4/4]`` int32 → one quarter ``[BLOCK_N, Q4]`` fp16 A operand.

        ``w & MASK`` turns bytes 0 and 2 of a word into two fp16 subnormals ``c·4^j·2^-24``
        at once (one ``lop3``), ``(w >> 8) & MASK`` bytes 1 and 3: per word one shift
        (shared by the four quarters) and two ``lop3`` per quarter. Element order inside a
        word is therefore bytes ``0, 2, 1, 3``; :func:`_load_qt` permutes the query the same way.
        """
        e0, e1, e2, e3 = gl.inline_asm_elementwise(
            "{ .reg .b32 t, u; and.b32 t, $4, " + MASK + "; mov.b32 {$0, $1}, t; "
            "shr.b32 u, $4, 8; and.b32 u, u, " + MASK + "; mov.b32 {$2, $3}, u; }",
            "=h,=h,=h,=h,r",
            [w],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True,
            pack=1,
        )
        # join appends the new dim last: join(join(e0, e2), join(e1, e3))[..., a, b] = e_(2a+b)
        x = gl.join(gl.join(e0, e2), gl.join(e1, e3))  # [BLOCK_N, W, 2 (a), 2 (b)]
        # word w = 8v + 2c + u (BLK: lane c holds words 2c, 2c+1 of every 8) → logical
        # k = 32v + 16u + 8a + 2c + b, which is exactly the k of lane c in the A operand
        # (k_width 2: k = 2c, 2c+1, 2c+8, 2c+9 per 16): the conversion to LA moves nothing
        x = gl.reshape(x, [BLOCK_N, Q4 // 32, 4, 2, 2, 2])
        x = gl.permute(x, [0, 1, 3, 4, 2, 5])
        return gl.convert_layout(gl.reshape(x, [BLOCK_N, Q4]), LA)

    @gluon.jit
    def _unpack_v(w, MASK: gl.constexpr, BLOCK_N: gl.constexpr, Q4: gl.constexpr, LA: gl.constexpr):
        """Value words ``[BLOCK_N, Q4/4]`` int32 → one quarter of ``vᵀ`` ``[Q4, BLOCK_N]`` fp16.

        Two tokens' words per call: ``prmt`` puts byte ``i`` of both side by side (shared by
        the four quarters), one ``and`` masks (fp16 subnormals, as :func:`_unpack_k`).
        Row ``m = w + (Q4/4)·i`` of the result is element ``4w + i`` of the quarter (:func:`_vrow`).
        """
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            "{ .reg .b32 t; "
            "prmt.b32 t, $4, $5, 0x4400; and.b32 $0, t, " + MASK + "; "
            "prmt.b32 t, $4, $5, 0x5511; and.b32 $1, t, " + MASK + "; "
            "prmt.b32 t, $4, $5, 0x6622; and.b32 $2, t, " + MASK + "; "
            "prmt.b32 t, $4, $5, 0x7733; and.b32 $3, t, " + MASK + "; }",
            "=r,=r,=r,=r,r,r",
            [w],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True,
            pack=2,
        )
        x = gl.join(gl.join(o0, o2), gl.join(o1, o3))  # [BLOCK_N, W, 2, 2]: [t, w, a, b] = o_(2a+b)
        x = gl.permute(x, [2, 3, 1, 0])  # (i, w, t)
        return gl.convert_layout(gl.reshape(x, [Q4, BLOCK_N]), LA)

    @gluon.jit
    def _vrow(m, Q4: gl.constexpr):
        """Element of a quarter held in row ``m`` of the value accumulators (see :func:`_unpack_v`)."""
        return 4 * (m % (Q4 // 4)) + m // (Q4 // 4)

    @gluon.jit
    def _load_qt(
        q_ptr,
        qrow,
        J: gl.constexpr,
        inv_f,
        Q4: gl.constexpr,
        LB: gl.constexpr,
        DT: gl.constexpr,
        PERM: gl.constexpr,
    ):
        """Quarter ``J`` of the queries as a B operand ``[Q4, NP]`` (``q_j / f_j`` in ``DT``).

        ``PERM``: in the order of the unpacked key tile (:func:`_unpack_k`).
        """
        dq = gl.arange(0, Q4, layout=gl.SliceLayout(1, LB))
        if PERM:  # logical k of the unpacked key tile → element of the quarter (_unpack_k)
            w = 8 * (dq // 32) + 2 * ((dq // 2) % 4) + (dq // 16) % 2
            i = 2 * ((dq // 8) % 2) + dq % 2  # asm output order: bytes 0, 2, 1, 3
            dq = 4 * w + i + (i == 1).to(gl.int32) - (i == 2).to(gl.int32)
        x = gl.load(q_ptr + qrow[None, :] + J * Q4 + dq[:, None], mask=qrow[None, :] >= 0, other=0.0)
        return (x.to(gl.float32) * inv_f).to(DT)

    @gluon.jit
    def _softmax_cols(s2, m_i):
        """Online max over the token axis (0) of ``s2 [BLOCK_N, NP]`` (log2 domain, -inf masked)."""
        m_new = gl.maximum(m_i, gl.max(s2, 0))
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s2 - m_safe[None, :])
        return p, alpha, m_new

    @gluon.jit
    def _cos_approx(x):
        """``cos.approx.f32`` (abs. error ~2^-21 on the reduced angles of :func:`_rope_scores`)."""
        return gl.inline_asm_elementwise(
            "cos.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
        )

    @gluon.jit
    def _sin_approx(x):
        """``sin.approx.f32`` (as :func:`_cos_approx`)."""
        return gl.inline_asm_elementwise(
            "sin.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
        )

    @gluon.jit
    def _reduce_angle(p, th_hi, th_lo):
        """``p·θ`` minus a multiple of ``2π`` (``p, θ >= 0``), as ``attention._rope_angle``."""
        a = p * th_hi
        b = p * th_lo  # up to ~1e3 rad near 2^17: n is rounded from the whole sum (|result| <= π)
        n = ((a + b) * 0.15915494309189535 + 0.5).to(gl.int32).to(gl.float32)  # round(p·θ / 2π)
        r = a - n * 6.28125  # exact: 8-bit 2π_hi, p·θ_hi exact (7-bit θ_hi, p < 2^17)
        r = r - n * 0.0019353071795864769
        return r + b

    @gluon.jit
    def _tf32_hi(x):
        """The tf32-exact part of ``x`` (10 mantissa bits; ``x - hi`` is the rest)."""
        return (x.to(gl.int32, bitcast=True) & -8192).to(gl.float32, bitcast=True)

    @gluon.jit
    def _rope_col_pair(k):
        """Pair slot of column ``k`` of the score term's operands: ``8j + 4s + i`` ↔ pair ``4j + i``,
        ``s`` = 0 cos, 1 sin: a thread of a tf32 operand holds the cos and the sin row/column of the
        same pairs (``c`` and ``c + 4`` of each 8), as the angle-addition form needs."""
        return 4 * (k // 8) + k % 4

    @gluon.jit
    def _rope_scores(
        t0, th_hi, th_lo, ph, rbh, rbl, BLOCK_N: gl.constexpr, NP: gl.constexpr, MMA: gl.constexpr,
        LA1: gl.constexpr,
    ):  # fmt: skip
        """Score term ``[BLOCK_N, NP]`` of the INT2 keys at ``t0 + [0, BLOCK_N)`` (pre-RoPE mean):
        ``A[t, k] = cos(p_t·θ_k + φ_k)`` (``φ = -π/2`` on sin columns; angles reduced exactly as
        ``attention._rope_angle``) times the coefficients ``B = rbh + rbl`` ``[K, NP]``, as three
        tf32 ``mma`` (hi·lo + lo·hi + hi·hi: ~2^-21 relative, float32-like)."""
        p = (t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LA1))).to(gl.float32)[:, None]
        x = _cos_approx(_reduce_angle(p, th_hi[None, :], th_lo[None, :]) + ph[None, :])
        return _mma3(x, rbh, rbl, BLOCK_N, NP, MMA)

    @gluon.jit
    def _mma3(x, bh, bl, BLOCK_N: gl.constexpr, NP: gl.constexpr, MMA: gl.constexpr):
        """``x @ (bh + bl)`` in float32-like precision from three tf32 ``mma`` (hi·lo + lo·hi + hi·hi)."""
        xh = _tf32_hi(x)
        acc = gl.zeros([BLOCK_N, NP], gl.float32, layout=MMA)
        # float32 operands: tf32 mma (Triton's default precision; the argument is not named so the
        # call compiles on Triton 3.6 too)
        acc = mma_v2(x - xh, bh, acc)
        acc = mma_v2(xh, bl, acc)
        return mma_v2(xh, bh, acc)

    @gluon.jit
    def _rope_scores_add(
        t0, al, tb_hi, tb_lo, sg, rc, rcs, BLOCK_N: gl.constexpr, NP: gl.constexpr, MMA: gl.constexpr
    ):  # fmt: skip
        """:func:`_rope_scores` by angle addition: ``cos((t0 + j)θ) = cos(t0θ)cos(jθ) - sin(t0θ)sin(jθ)``
        (and ``sin``), so the ``[BLOCK_N, K]`` operand ``al[j, k] = cos(jθ_k + φ_k)`` is the same for
        every tile (loop-invariant, computed once) and a tile only turns the coefficients by its
        start: ``W0 = C0·cos(t0θ) + C1·sin(t0θ)``, ``W1 = C1·cos(t0θ) - C0·sin(t0θ)`` (``rc``: C,
        ``rcs``: C with the cos and sin rows swapped, ``sg`` = +1 / -1 on cos / sin rows): a few
        angles per thread and tile instead of one per element of ``al``."""
        t = t0.to(gl.float32)
        a = _reduce_angle(t, tb_hi, tb_lo)
        w = _cos_approx(a)[:, None] * rc + (sg * _sin_approx(a))[:, None] * rcs
        wh = _tf32_hi(w)
        return _mma3(al, wh, w - wh, BLOCK_N, NP, MMA)

    @gluon.jit
    def _rope_operands(
        rc_ptr, rth_ptr, crow, ROPE_R: gl.constexpr, ROPE_P: gl.constexpr, LA1: gl.constexpr,
        LB1: gl.constexpr,
    ):  # fmt: skip
        """Loop-invariant operands of :func:`_rope_scores`: per column ``θ_hi, θ_lo, φ`` (``LA1``
        columns) and the coefficients ``rc [.., 2, ROPE_P]`` of the query heads at offsets ``crow``
        (``-1``: padding) as ``B [2·ROPE_P, NP]`` tf32 hi + lo, times ``2^-23`` (the scores' unit)."""
        K: gl.constexpr = 2 * ROPE_P
        ka = gl.arange(0, K, layout=gl.SliceLayout(0, LA1))
        ra = _rope_col_pair(ka)
        th = gl.load(rth_ptr + ra, mask=ra < ROPE_R, other=0.0)
        th_hi = _theta_hi(th)
        ph = gl.where((ka // 4) % 2 == 1, -1.5707963267948966, 0.0)
        kb = gl.arange(0, K, layout=gl.SliceLayout(1, LB1))
        cr = gl.convert_layout(crow, gl.SliceLayout(0, LB1))
        off = ((kb // 4) % 2) * ROPE_P + _rope_col_pair(kb)
        c = gl.load(rc_ptr + cr[None, :] + off[:, None], mask=(cr >= 0)[None, :], other=0.0) * (2.0**-23)
        ch = _tf32_hi(c)
        return th_hi, th - th_hi, ph, ch, c - ch

    @gluon.jit
    def _rope_operands_add(
        rc_ptr, rth_ptr, crow, ROPE_R: gl.constexpr, ROPE_P: gl.constexpr, BLOCK_N: gl.constexpr,
        LA1: gl.constexpr, LB1: gl.constexpr,
    ):  # fmt: skip
        """Loop-invariant operands of :func:`_rope_scores_add`: ``al [BLOCK_N, K]`` (``LA1``), per
        row of ``B`` the split ``θ`` and the sign, and ``C``, ``C`` with cos/sin rows swapped
        (``LB1``, times ``2^-23``)."""
        K: gl.constexpr = 2 * ROPE_P
        ka = gl.arange(0, K, layout=gl.SliceLayout(0, LA1))
        ra = _rope_col_pair(ka)
        th = gl.load(rth_ptr + ra, mask=ra < ROPE_R, other=0.0)
        th_hi = _theta_hi(th)
        j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LA1)).to(gl.float32)[:, None]
        ph = gl.where((ka // 4) % 2 == 1, -1.5707963267948966, 0.0)
        al = _cos_approx(_reduce_angle(j, th_hi[None, :], (th - th_hi)[None, :]) + ph[None, :])
        kb = gl.arange(0, K, layout=gl.SliceLayout(1, LB1))
        rb = _rope_col_pair(kb)
        tb = gl.load(rth_ptr + rb, mask=rb < ROPE_R, other=0.0)
        tb_hi = _theta_hi(tb)
        sb = (kb // 4) % 2  # 0: cos row, 1: sin row
        sg = gl.where(sb == 1, -1.0, 1.0)
        cr = gl.convert_layout(crow, gl.SliceLayout(0, LB1))
        cm = (cr >= 0)[None, :]
        cp = rc_ptr + cr[None, :] + rb[:, None]
        rc = gl.load(cp + (sb * ROPE_P)[:, None], mask=cm, other=0.0) * (2.0**-23)
        rcs = gl.load(cp + ((1 - sb) * ROPE_P)[:, None], mask=cm, other=0.0) * (2.0**-23)
        return al, tb_hi, tb - tb_hi, sg, rc, rcs

    @gluon.jit
    def _theta_hi(th):
        """``θ`` to 7 significant bits (``p·θ_hi`` exact for ``p < 2^17``; ``θ - θ_hi`` is the rest)."""
        return (th.to(gl.int32, bitcast=True) & -131072).to(gl.float32, bitcast=True)

    @gluon.jit
    def _int2_step(
        kc,
        vc,
        ks,
        kz,
        vs,
        vz,
        ms,
        qt0,
        qt1,
        qt2,
        qt3,
        qsum,
        k_scale_log2,
        m_i,
        l_i,
        lpz,
        a0,
        a1,
        a2,
        a3,
        BLOCK_N: gl.constexpr,
        Q4: gl.constexpr,
        NP: gl.constexpr,
        MMA: gl.constexpr,
        LA: gl.constexpr,
        LB: gl.constexpr,
        t0=0,
        r0=0,
        r1=0,
        r2=0,
        r3=0,
        r4=0,
        r5=0,
        ROPE: gl.constexpr = 0,
        LA1: gl.constexpr = None,
    ):
        """One INT2 tile into the online softmax: code words ``kc`` / ``vc`` (:func:`_int2_tile`
        layouts ``BLK`` / ``BLV``), per-token scale/zero, mask ``ms``; the same body for the
        register-prefetch and the ``cp.async`` paths. Returns ``m_i, l_i, lpz, a0 … a3``.
        ``ROPE``: plus the pre-RoPE mean's term of the tile at ``t0``: 1 :func:`_rope_scores`, 2
        :func:`_rope_scores_add` (``r0 …``: the operands of :func:`_rope_operands` /
        :func:`_rope_operands_add`)."""
        st = gl.zeros([BLOCK_N, NP], gl.float32, layout=MMA)
        st = mma_v2(_unpack_k(kc, "0x00030003", BLOCK_N, Q4, LA), qt0, st)
        st = mma_v2(_unpack_k(kc, "0x000C000C", BLOCK_N, Q4, LA), qt1, st)
        st = mma_v2(_unpack_k(kc, "0x00300030", BLOCK_N, Q4, LA), qt2, st)
        st = mma_v2(_unpack_k(kc, "0x00C000C0", BLOCK_N, Q4, LA), qt3, st)
        s = st * ks[:, None] + qsum[None, :] * kz[:, None]
        if ROPE == 1:
            s = s + _rope_scores(t0, r0, r1, r2, r3, r4, BLOCK_N, NP, MMA, LA1)
        elif ROPE == 2:
            s = s + _rope_scores_add(t0, r0, r1, r2, r3, r4, r5, BLOCK_N, NP, MMA)
        s2 = gl.where(ms[:, None], s * k_scale_log2, float("-inf"))
        p, alpha, m_i = _softmax_cols(s2, m_i)
        l_i = l_i * alpha + gl.sum(p, 0)
        pv = (p * vs[:, None]).to(gl.float16)
        lpz = lpz * alpha + gl.sum(p * vz[:, None], 0)
        pb = gl.convert_layout(pv, LB)
        # the accumulators hold Σ p·s·c·4^j·2^-24 (no offset: the operands are exact
        # subnormals, so nothing large is ever added and cancelled)
        a0 = mma_v2(_unpack_v(vc, "0x00030003", BLOCK_N, Q4, LA), pb, a0 * alpha[None, :])
        a1 = mma_v2(_unpack_v(vc, "0x000C000C", BLOCK_N, Q4, LA), pb, a1 * alpha[None, :])
        a2 = mma_v2(_unpack_v(vc, "0x00300030", BLOCK_N, Q4, LA), pb, a2 * alpha[None, :])
        a3 = mma_v2(_unpack_v(vc, "0x00C000C0", BLOCK_N, Q4, LA), pb, a3 * alpha[None, :])
        return m_i, l_i, lpz, a0, a1, a2, a3

    @gluon.jit
    def _int2_tile(
        kw_ptr,
        vw_ptr,
        ks_ptr,
        kz_ptr,
        vs_ptr,
        vz_ptr,
        bt_ptr,
        bt_row,
        t0,
        hi,
        pg,
        page_size,
        h,
        stride_cp,
        stride_ch,
        stride_ct,
        stride_sp,
        stride_sh,
        stride_st,
        BLOCK_N: gl.constexpr,
        Q4: gl.constexpr,
        BLK: gl.constexpr,
        BLV: gl.constexpr,
        ROWL: gl.constexpr,
        ONE_PAGE: gl.constexpr,
    ):
        """Load one INT2 tile: key and value code words ``[BLOCK_N, Q4/4]`` int32 (keys 8 bytes,
        values 4 bytes per thread and load) and per-token scale/zero; masked past ``hi``.
        ``pg``: the tile's page id (:func:`_page`; used with ``ONE_PAGE`` only)."""
        W4: gl.constexpr = Q4 // 4
        if ONE_PAGE:
            # the tile lies inside one page (page_size % BLOCK_N == 0, tiles start at multiples
            # of BLOCK_N): one block-table entry and 32-bit offsets from a scalar base replace
            # a per-token division, remainder and 64-bit address computation
            off = t0 % page_size
            ct4 = stride_ct // 4
            wk = gl.arange(0, W4, layout=gl.SliceLayout(0, BLK))
            lk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, BLK))
            cbase = (pg.to(gl.int64) * stride_cp + h * stride_ch + off * stride_ct) // 4
            mk = (t0 + lk) < hi
            kc = gl.load(kw_ptr + cbase + (lk * ct4)[:, None] + wk[None, :], mask=mk[:, None], other=0)
            wv = gl.arange(0, W4, layout=gl.SliceLayout(0, BLV))
            lv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, BLV))
            mv = (t0 + lv) < hi
            vc = gl.load(vw_ptr + cbase + (lv * ct4)[:, None] + wv[None, :], mask=mv[:, None], other=0)
            ls = gl.arange(0, BLOCK_N, layout=ROWL)
            ms = (t0 + ls) < hi
            sbase = pg.to(gl.int64) * stride_sp + h * stride_sh + off * stride_st
            rs = ls * stride_st
            ks = gl.load(ks_ptr + sbase + rs, mask=ms, other=0.0).to(gl.float32)
            kz = gl.load(kz_ptr + sbase + rs, mask=ms, other=0.0).to(gl.float32)
            vs = gl.load(vs_ptr + sbase + rs, mask=ms, other=0.0).to(gl.float32)
            vz = gl.load(vz_ptr + sbase + rs, mask=ms, other=0.0).to(gl.float32)
        else:
            tk = t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, BLK))
            mk = tk < hi
            pk = gl.load(bt_ptr + bt_row + tk // page_size, mask=mk, other=0).to(gl.int64)
            rk = (pk * stride_cp + h * stride_ch + (tk % page_size) * stride_ct) // 4
            wk = gl.arange(0, W4, layout=gl.SliceLayout(0, BLK))
            kc = gl.load(kw_ptr + rk[:, None] + wk[None, :], mask=mk[:, None], other=0)
            tv = t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, BLV))
            mv = tv < hi
            pv = gl.load(bt_ptr + bt_row + tv // page_size, mask=mv, other=0).to(gl.int64)
            rv = (pv * stride_cp + h * stride_ch + (tv % page_size) * stride_ct) // 4
            wv = gl.arange(0, W4, layout=gl.SliceLayout(0, BLV))
            vc = gl.load(vw_ptr + rv[:, None] + wv[None, :], mask=mv[:, None], other=0)
            ts = t0 + gl.arange(0, BLOCK_N, layout=ROWL)
            ms = ts < hi
            ps = gl.load(bt_ptr + bt_row + ts // page_size, mask=ms, other=0).to(gl.int64)
            rs = ps * stride_sp + h * stride_sh + (ts % page_size) * stride_st
            ks = gl.load(ks_ptr + rs, mask=ms, other=0.0).to(gl.float32)
            kz = gl.load(kz_ptr + rs, mask=ms, other=0.0).to(gl.float32)
            vs = gl.load(vs_ptr + rs, mask=ms, other=0.0).to(gl.float32)
            vz = gl.load(vz_ptr + rs, mask=ms, other=0.0).to(gl.float32)
        return kc, vc, ks, kz, vs, vz, ms

    @gluon.jit
    def _int2_issue(
        kb,
        vb,
        sb,
        kw_ptr,
        vw_ptr,
        ks_ptr,
        kz_ptr,
        vs_ptr,
        vz_ptr,
        t0,
        hi,
        pg,
        page_size,
        h,
        stride_cp,
        stride_ch,
        stride_ct,
        stride_sp,
        stride_sh,
        stride_st,
        BLOCK_N: gl.constexpr,
        Q4: gl.constexpr,
        BLK: gl.constexpr,
        BLV: gl.constexpr,
        SCL: gl.constexpr,
        WIDE: gl.constexpr,
    ):
        """``ASYNC``: request one INT2 tile (one page, as ``ONE_PAGE``) with ``cp.async`` into the
        shared-memory stage ``kb`` / ``vb`` (code words, copy layouts ``BLK`` / ``BLV``) and ``sb``
        (k scale, k zero, v scale, v zero), zero-filled past ``hi``; one commit group per tile.

        ``WIDE``: the scale/zero rows are copied whole once the tile starts before ``hi`` (the
        tokens past ``hi`` lie in the same page; the caller zeroes their value scale/zero, which
        may be any bits there), else per pair of tokens."""
        W4: gl.constexpr = Q4 // 4
        off = t0 % page_size
        ct4 = stride_ct // 4
        cbase = (pg.to(gl.int64) * stride_cp + h * stride_ch + off * stride_ct) // 4
        wk = gl.arange(0, W4, layout=gl.SliceLayout(0, BLK))
        lk = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, BLK))
        mk = ((t0 + lk) < hi)[:, None] & (wk >= 0)[None, :]
        _cp_async(kb, kw_ptr + cbase + (lk * ct4)[:, None] + wk[None, :], mask=mk)
        wv = gl.arange(0, W4, layout=gl.SliceLayout(0, BLV))
        lv = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, BLV))
        mv = ((t0 + lv) < hi)[:, None] & (wv >= 0)[None, :]
        _cp_async(vb, vw_ptr + cbase + (lv * ct4)[:, None] + wv[None, :], mask=mv)
        # scales / zeros as int32 pairs of tokens (cp.async moves >= 4 bytes): rows k scale,
        # k zero, v scale, v zero of a [4, BLOCK_N / 2] word tile
        r = gl.arange(0, 4, layout=gl.SliceLayout(1, SCL))
        lw = gl.arange(0, BLOCK_N // 2, layout=gl.SliceLayout(0, SCL))
        so = (pg.to(gl.int64) * stride_sp + h * stride_sh + off * stride_st) // 2 + lw
        kw2 = ks_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        zw2 = kz_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        vw2 = vs_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        ww2 = vz_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
        rr = gl.zeros([4, BLOCK_N // 2], gl.int32, SCL) + r[:, None]
        base = gl.where(rr == 0, kw2, gl.where(rr == 1, zw2, gl.where(rr == 2, vw2, ww2)))
        if WIDE:
            ms = (rr >= 0) & (t0 < hi)
        else:
            ms = (rr >= 0) & ((t0 + 2 * lw) < hi)[None, :]
        _cp_async(sb, base + so[None, :], mask=ms)
        _acp.commit_group()

    @gluon.jit
    def _scales(w, BLOCK_N: gl.constexpr, ROWL: gl.constexpr):
        """``[4, BLOCK_N / 2]`` int32 words of bf16 pairs (:func:`_int2_issue`) → k scale, k zero,
        v scale, v zero ``[BLOCK_N]`` float32 in ``ROWL`` (bf16 → fp32 is a 16-bit shift)."""
        lo = (w << 16).to(gl.float32, bitcast=True)
        hi = (w & -65536).to(gl.float32, bitcast=True)
        x = gl.reshape(gl.join(lo, hi), [4, BLOCK_N])  # token 2j + parity
        r = gl.arange(0, 4, layout=gl.SliceLayout(1, x.type.layout))[:, None]
        ks = gl.convert_layout(gl.sum(gl.where(r == 0, x, 0.0), 0), ROWL)
        kz = gl.convert_layout(gl.sum(gl.where(r == 1, x, 0.0), 0), ROWL)
        vs = gl.convert_layout(gl.sum(gl.where(r == 2, x, 0.0), 0), ROWL)
        vz = gl.convert_layout(gl.sum(gl.where(r == 3, x, 0.0), 0), ROWL)
        return ks, kz, vs, vz

    @gluon.jit
    def _warp_sync(num_warps: gl.constexpr):
        """``bar.warp.sync``: every lane's shared-memory accesses before it are done (one-warp
        programs: the ``cp.async`` ring's read-after-write and write-after-read order)."""
        x = gl.arange(0, 32 * num_warps, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        gl.inline_asm_elementwise(
            "bar.warp.sync -1; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _griddep(OP: gl.constexpr, num_warps: gl.constexpr):
        """``griddepcontrol.<OP>`` (``wait`` / ``launch_dependents``): programmatic dependent
        launch, sm_90+. A side-effecting asm, so neither it nor the loads after it move."""
        x = gl.arange(0, 32 * num_warps, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        gl.inline_asm_elementwise(
            "griddepcontrol." + OP + "; mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _page(bt_ptr, bt_row, t0, hi, page_size):
        """Page id (int32: int64 only where an address is formed) of the tile at ``t0`` (0 past ``hi``)."""
        return gl.load(bt_ptr + bt_row + t0 // page_size, mask=t0 < hi, other=0)

    @gluon.jit
    def _bf16_window(
        qb0,
        qb1,
        qb2,
        qb3,
        m_i,
        l_i,
        a0,
        a1,
        a2,
        a3,
        base_k,
        base_v,
        lo,
        hi,
        ring,
        stride_row,
        sm_scale_log2,
        BLOCK_W: gl.constexpr,
        Q4: gl.constexpr,
        NP: gl.constexpr,
        MMA: gl.constexpr,
        LA: gl.constexpr,
        LB: gl.constexpr,
    ):
        """Attend to bf16 rows ``(tok % ring) * stride_row`` for ``tok`` in ``[lo, hi)`` (window)."""
        dk = gl.arange(0, Q4, layout=gl.SliceLayout(0, LA))
        dv = _vrow(gl.arange(0, Q4, layout=gl.SliceLayout(1, LA)), Q4)  # rows as the INT2 path
        for t0 in range(lo, hi, BLOCK_W):
            tk = t0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, LA))
            rk = (tk % ring).to(gl.int64) * stride_row
            kp = base_k + rk[:, None] + dk[None, :]
            km = (tk < hi)[:, None]
            st = gl.zeros([BLOCK_W, NP], gl.float32, layout=MMA)
            st = mma_v2(gl.load(kp, mask=km, other=0.0), qb0, st)
            st = mma_v2(gl.load(kp + Q4, mask=km, other=0.0), qb1, st)
            st = mma_v2(gl.load(kp + 2 * Q4, mask=km, other=0.0), qb2, st)
            st = mma_v2(gl.load(kp + 3 * Q4, mask=km, other=0.0), qb3, st)
            ts = t0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(1, MMA))
            s2 = gl.where((ts < hi)[:, None], st * sm_scale_log2, float("-inf"))
            p, alpha, m_i = _softmax_cols(s2, m_i)
            l_i = l_i * alpha + gl.sum(p, 0)
            pb = gl.convert_layout(p.to(gl.bfloat16), LB)
            tv = t0 + gl.arange(0, BLOCK_W, layout=gl.SliceLayout(0, LA))
            rv = (tv % ring).to(gl.int64) * stride_row
            vp = base_v + rv[None, :] + dv[:, None]
            vm = (tv < hi)[None, :]
            a0 = mma_v2(gl.load(vp, mask=vm, other=0.0), pb, a0 * alpha[None, :])
            a1 = mma_v2(gl.load(vp + Q4, mask=vm, other=0.0), pb, a1 * alpha[None, :])
            a2 = mma_v2(gl.load(vp + 2 * Q4, mask=vm, other=0.0), pb, a2 * alpha[None, :])
            a3 = mma_v2(gl.load(vp + 3 * Q4, mask=vm, other=0.0), pb, a3 * alpha[None, :])
        return m_i, l_i, a0, a1, a2, a3

    @gluon.jit
    def decode_split_kernel_gluon(
        q_ptr,
        stride_qb,
        stride_qh,
        kc_ptr,
        vc_ptr,
        stride_cp,
        stride_ch,
        stride_ct: gl.constexpr,
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
        page_size: gl.constexpr,
        NUM_SPLITS,
        H_KV: gl.constexpr,
        GQA: gl.constexpr,
        NP: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        SINK: gl.constexpr,
        RECENT: gl.constexpr,
        RING: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_W: gl.constexpr,
        W_TOK: gl.constexpr,
        PREFETCH: gl.constexpr,
        ONE_PAGE: gl.constexpr,
        PDL: gl.constexpr,
        ASYNC: gl.constexpr,
        ASYNC_WIDE: gl.constexpr,
        num_warps: gl.constexpr,
        rc_ptr=None,
        rth_ptr=None,
        ROPE_R: gl.constexpr = 0,
        ROPE_P: gl.constexpr = 0,
        ROPE_MODE: gl.constexpr = 0,
    ):
        """Program ``(b*H_kv + h, split)``: INT2 splits as in ``attention.decode_split_kernel``
        (``NUM_SPLITS`` is a run-time argument here: one compiled kernel serves every batch),
        then :func:`window_programs` programs of ``W_TOK`` BF16 window tokens each.
        ``ROPE_R > 0``: INT2 scores get the pre-RoPE mean's term of the coefficients
        ``rc [B, H_q, 2, ROPE_P]`` and ``θ`` ``rth [ROPE_R]`` (0: today's kernel), one angle per
        element (``ROPE_MODE`` 1, :func:`_rope_scores`) or by angle addition (2,
        :func:`_rope_scores_add`: fewer operations, ``BLOCK_N·2·ROPE_P / 32`` more registers;
        ``ROPE_MODE`` is 0 exactly when ``ROPE_R`` is)."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, 8]
        )
        # k_width counts elements per 32 bits: 2 for 16-bit operands (the probe's 4 and 8 are
        # for 8/4-bit types and made mma_v2 pair the wrong k of A and B on the H200)
        LA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        LB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        # code words: keys 2 words (8 bytes) per thread and row, values 1 word per thread and
        # token, token pairs 2c, 2c+1 (+8): both own exactly the elements of their A operand
        # (LA, k_width 2), so the conversion after the unpack moves no data between threads
        BLK: gl.constexpr = gl.BlockedLayout([1, 2], [8, 4], [num_warps, 1], [1, 0])
        BLV: gl.constexpr = gl.BlockedLayout([2, 1], [4, 8], [num_warps, 1], [0, 1])
        ROWL: gl.constexpr = gl.SliceLayout(1, MMA)  # per token of a score tile
        COLL: gl.constexpr = gl.SliceLayout(0, MMA)  # per query head
        Q4: gl.constexpr = HEAD_DIM // 4
        NWS: gl.constexpr = (SINK + W_TOK - 1) // W_TOK  # window programs: sink, then recent
        NWR: gl.constexpr = (RECENT + W_TOK - 1) // W_TOK
        NT = NUM_SPLITS + NWS + NWR
        if PDL:  # the merge kernel may launch now; it waits for this grid before reading
            _griddep("launch_dependents", num_warps)
        pid = gl.program_id(0)
        split = gl.program_id(1)
        b = pid // H_KV
        h = pid % H_KV
        length = gl.load(seqlen_ptr + b)
        # query heads of this KV head as B-operand columns (padded columns point nowhere: -1)
        nb = gl.arange(0, NP, layout=gl.SliceLayout(0, LB))
        qrow = gl.where(nb < GQA, b * stride_qb + (h * GQA + nb) * stride_qh, -1)
        m_i = gl.full([NP], float("-inf"), gl.float32, layout=COLL)
        l_i = gl.zeros([NP], gl.float32, layout=COLL)
        a0 = gl.zeros([Q4, NP], gl.float32, layout=MMA)
        a1 = gl.zeros([Q4, NP], gl.float32, layout=MMA)
        a2 = gl.zeros([Q4, NP], gl.float32, layout=MMA)
        a3 = gl.zeros([Q4, NP], gl.float32, layout=MMA)
        # INT2 split `split`'s tokens [lo, hi) (empty for the window programs: lo >= end)
        end = gl.maximum(length - RECENT, SINK)
        per = gl.cdiv(gl.cdiv(end - SINK, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = SINK + split * per
        hi = gl.minimum(end, lo + per)
        if PDL:  # the rotated queries are the previous kernel's output
            _griddep("wait", num_warps)
        if (split < NUM_SPLITS) & (lo < hi):
            # Σ(p·z) per head: o_j = a_j·2^24/4^j + lpz (see module docstring)
            lpz = gl.zeros([NP], gl.float32, layout=COLL)
            # q_j·2/4^j: quarter j's products are c·q·2^-23 (x = c·4^j·2^-24), all quarters alike
            qt0 = _load_qt(q_ptr, qrow, 0, 2.0, Q4, LB, gl.float16, True)
            qt1 = _load_qt(q_ptr, qrow, 1, 0.5, Q4, LB, gl.float16, True)
            qt2 = _load_qt(q_ptr, qrow, 2, 0.125, Q4, LB, gl.float16, True)
            qt3 = _load_qt(q_ptr, qrow, 3, 0.03125, Q4, LB, gl.float16, True)
            # Σq (exact query) per head, times 2^-23: s·2^-23 = st·ks + qsum·kz, and the 2^23 goes
            # into the softmax scale (no per-tile multiply)
            qsum = gl.sum(_load_qt(q_ptr, qrow, 0, 1.0, Q4, LB, gl.float32, False), 0)
            qsum += gl.sum(_load_qt(q_ptr, qrow, 1, 1.0, Q4, LB, gl.float32, False), 0)
            qsum += gl.sum(_load_qt(q_ptr, qrow, 2, 1.0, Q4, LB, gl.float32, False), 0)
            qsum += gl.sum(_load_qt(q_ptr, qrow, 3, 1.0, Q4, LB, gl.float32, False), 0)
            qsum = gl.convert_layout(qsum, COLL) * (2.0**-23)
            k_scale_log2 = sm_scale_log2 * (2.0**23)
            if ROPE_R > 0:  # tf32 operands of the score term (32-bit: k_width 1)
                LA1: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=1)
                LB1: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=1)
                crow = gl.where(nb < GQA, (b * (H_KV * GQA) + h * GQA + nb) * (2 * ROPE_P), -1)
                if ROPE_MODE == 2:
                    r0, r1, r2, r3, r4, r5 = _rope_operands_add(
                        rc_ptr, rth_ptr, crow, ROPE_R, ROPE_P, BLOCK_N, LA1, LB1
                    )
                else:
                    r0, r1, r2, r3, r4 = _rope_operands(rc_ptr, rth_ptr, crow, ROPE_R, ROPE_P, LA1, LB1)
                    r5 = 0
            else:
                LA1: gl.constexpr = LA
                r0 = 0
                r1 = 0
                r2 = 0
                r3 = 0
                r4 = 0
                r5 = 0
            bt_row = b * stride_bt
            kw_ptr = kc_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
            vw_ptr = vc_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
            if ASYNC > 0:
                # cp.async ring of ASYNC stages: tile i + ASYNC - 1 is requested before tile i is
                # computed, with no registers held for it (register prefetch: ptxas issued the
                # next tile's loads in the second half of the iteration, docs/performance.md)
                W4: gl.constexpr = Q4 // 4
                SL2: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
                kb = gl.allocate_shared_memory(gl.int32, [ASYNC, BLOCK_N, W4], SL2)
                vb = gl.allocate_shared_memory(gl.int32, [ASYNC, BLOCK_N, W4], SL2)
                sb = gl.allocate_shared_memory(gl.int32, [ASYNC, 4, BLOCK_N // 2], SL2)
                SCL: gl.constexpr = gl.BlockedLayout([1, 1], [2, 16], [num_warps, 1], [1, 0])
                if ASYNC_WIDE:
                    # copies of 16 bytes (4 code words of a token) per thread: 4 LDGSTS per 32-token
                    # tile for the codes instead of 12 in the compute layouts (8-byte keys, 4-byte values)
                    CPK: gl.constexpr = gl.BlockedLayout(
                        [1, 4], [32 // (W4 // 4), W4 // 4], [num_warps, 1], [1, 0]
                    )
                    CPV: gl.constexpr = CPK
                else:
                    CPK: gl.constexpr = BLK
                    CPV: gl.constexpr = BLV
                for st0 in gl.static_range(ASYNC - 1):
                    _int2_issue(
                        kb.index(st0), vb.index(st0), sb.index(st0), kw_ptr, vw_ptr, ks_ptr, kz_ptr, vs_ptr,
                        vz_ptr, lo + st0 * BLOCK_N, hi,
                        _page(bt_ptr, bt_row, lo + st0 * BLOCK_N, hi, page_size), page_size, h, stride_cp,
                        stride_ch, stride_ct, stride_sp, stride_sh, stride_st, BLOCK_N, Q4, CPK, CPV, SCL,
                        ASYNC_WIDE,
                    )  # fmt: skip
                pga = _page(bt_ptr, bt_row, lo + (ASYNC - 1) * BLOCK_N, hi, page_size)
                ls_r = gl.arange(0, BLOCK_N, layout=ROWL)
                for t0 in range(lo, hi, BLOCK_N):
                    i = (t0 - lo) // BLOCK_N
                    sn = (i + ASYNC - 1) % ASYNC
                    pgn = _page(bt_ptr, bt_row, t0 + ASYNC * BLOCK_N, hi, page_size)
                    _warp_sync(num_warps)  # stage sn was read in the previous iteration
                    _int2_issue(
                        kb.index(sn), vb.index(sn), sb.index(sn), kw_ptr, vw_ptr, ks_ptr, kz_ptr, vs_ptr,
                        vz_ptr, t0 + (ASYNC - 1) * BLOCK_N, hi, pga, page_size, h, stride_cp, stride_ch,
                        stride_ct, stride_sp, stride_sh, stride_st, BLOCK_N, Q4, CPK, CPV, SCL, ASYNC_WIDE,
                    )  # fmt: skip
                    pga = pgn
                    _acp.wait_group(ASYNC - 1)  # tile i has landed (this thread's copies)
                    _warp_sync(num_warps)  # ... and every other lane's
                    sc = i % ASYNC
                    kc = kb.index(sc).load(BLK)
                    vc = vb.index(sc).load(BLV)
                    ks, kz, vs, vz = _scales(sb.index(sc).load(SCL), BLOCK_N, ROWL)
                    ms = (t0 + ls_r) < hi
                    # scale/zero words past hi may be copied (whole rows, or the pair of the last
                    # token): p = 0 there, but 0·NaN is not 0
                    vs = gl.where(ms, vs, 0.0)
                    vz = gl.where(ms, vz, 0.0)
                    m_i, l_i, lpz, a0, a1, a2, a3 = _int2_step(
                        kc, vc, ks, kz, vs, vz, ms, qt0, qt1, qt2, qt3, qsum, k_scale_log2,
                        m_i, l_i, lpz, a0, a1, a2, a3, BLOCK_N, Q4, NP, MMA, LA, LB,
                        t0, r0, r1, r2, r3, r4, r5, ROPE_MODE, LA1,
                    )  # fmt: skip
                _acp.wait_group(0)
            else:
                if PREFETCH:
                    kc, vc, ks, kz, vs, vz, ms = _int2_tile(
                        kw_ptr, vw_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, bt_ptr, bt_row, lo, hi,
                        _page(bt_ptr, bt_row, lo, hi, page_size), page_size, h,
                        stride_cp, stride_ch, stride_ct, stride_sp, stride_sh, stride_st,
                        BLOCK_N, Q4, BLK, BLV, ROWL, ONE_PAGE,
                    )  # fmt: skip
                    # page ids one iteration ahead: the next tile's loads never wait for a block-table
                    # load issued in the same iteration (in-order issue would stall the warp on it)
                    pg1 = _page(bt_ptr, bt_row, lo + BLOCK_N, hi, page_size)
                for t0 in range(lo, hi, BLOCK_N):
                    if PREFETCH:  # the next tile is requested before this one is computed
                        pg2 = _page(bt_ptr, bt_row, t0 + 2 * BLOCK_N, hi, page_size)
                        kc_n, vc_n, ks_n, kz_n, vs_n, vz_n, ms_n = _int2_tile(
                            kw_ptr, vw_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, bt_ptr, bt_row, t0 + BLOCK_N, hi,
                            pg1, page_size, h, stride_cp, stride_ch, stride_ct, stride_sp, stride_sh,
                            stride_st, BLOCK_N, Q4, BLK, BLV, ROWL, ONE_PAGE,
                        )  # fmt: skip
                    else:  # fewer registers, more resident programs instead
                        kc, vc, ks, kz, vs, vz, ms = _int2_tile(
                            kw_ptr, vw_ptr, ks_ptr, kz_ptr, vs_ptr, vz_ptr, bt_ptr, bt_row, t0, hi,
                            _page(bt_ptr, bt_row, t0, hi, page_size), page_size,
                            h, stride_cp, stride_ch, stride_ct, stride_sp, stride_sh, stride_st,
                            BLOCK_N, Q4, BLK, BLV, ROWL, ONE_PAGE,
                        )  # fmt: skip
                    m_i, l_i, lpz, a0, a1, a2, a3 = _int2_step(
                        kc, vc, ks, kz, vs, vz, ms, qt0, qt1, qt2, qt3, qsum, k_scale_log2,
                        m_i, l_i, lpz, a0, a1, a2, a3, BLOCK_N, Q4, NP, MMA, LA, LB,
                        t0, r0, r1, r2, r3, r4, r5, ROPE_MODE, LA1,
                    )  # fmt: skip
                    if PREFETCH:
                        pg1 = pg2
                        kc = kc_n
                        vc = vc_n
                        ks = ks_n
                        kz = kz_n
                        vs = vs_n
                        vz = vz_n
                        ms = ms_n
            a0 = a0 * (2.0**24) + lpz[None, :]
            a1 = a1 * (2.0**22) + lpz[None, :]
            a2 = a2 * (2.0**20) + lpz[None, :]
            a3 = a3 * (2.0**18) + lpz[None, :]
        elif split >= NUM_SPLITS:
            qb0 = _load_qt(q_ptr, qrow, 0, 1.0, Q4, LB, gl.bfloat16, False)
            qb1 = _load_qt(q_ptr, qrow, 1, 1.0, Q4, LB, gl.bfloat16, False)
            qb2 = _load_qt(q_ptr, qrow, 2, 1.0, Q4, LB, gl.bfloat16, False)
            qb3 = _load_qt(q_ptr, qrow, 3, 1.0, Q4, LB, gl.bfloat16, False)
            ws = gl.load(wslot_ptr + b).to(gl.int64)
            # window program w: W_TOK tokens of the sink (w < NWS) or of the recent window, so
            # no program walks all 256 ring rows serially (that one warp bounded short contexts)
            w = split - NUM_SPLITS
            if w < NWS:
                if SINK > 0:
                    wlo = w * W_TOK
                    m_i, l_i, a0, a1, a2, a3 = _bf16_window(
                        qb0, qb1, qb2, qb3, m_i, l_i, a0, a1, a2, a3,
                        ksink_ptr + ws * stride_ws0 + h * stride_ws1,
                        vsink_ptr + ws * stride_ws0 + h * stride_ws1,
                        wlo, gl.minimum(gl.minimum(length, SINK), wlo + W_TOK), 1 << 30, stride_ws2,
                        sm_scale_log2, BLOCK_W, Q4, NP, MMA, LA, LB,
                    )  # fmt: skip
            else:
                if RECENT > 0:
                    wlo = gl.maximum(length - RECENT, SINK) + (w - NWS) * W_TOK
                    m_i, l_i, a0, a1, a2, a3 = _bf16_window(
                        qb0, qb1, qb2, qb3, m_i, l_i, a0, a1, a2, a3,
                        kring_ptr + ws * stride_wr0 + h * stride_wr1,
                        vring_ptr + ws * stride_wr0 + h * stride_wr1,
                        wlo, gl.minimum(length, wlo + W_TOK), RING, stride_wr2, sm_scale_log2,
                        BLOCK_W, Q4, NP, MMA, LA, LB,
                    )  # fmt: skip
        has = l_i > 0
        lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        n = gl.arange(0, NP, layout=COLL)
        dm = _vrow(gl.arange(0, Q4, layout=gl.SliceLayout(1, MMA)), Q4)
        prow = (b * (H_KV * GQA) + h * GQA + n) * NT + split
        optr = po_ptr + prow.to(gl.int64)[None, :] * HEAD_DIM + dm[:, None]
        # an empty split (most of a short sequence's under a wide block table: the split count is
        # planned for the table's width, the splits' length for the sequence's) skips its queries
        # and stores only lse = -inf: the merges do not read its o
        om = ((n < GQA) & has)[None, :] & (dm >= 0)[:, None]
        gl.store(optr, a0 * inv[None, :], mask=om)
        gl.store(optr + Q4, a1 * inv[None, :], mask=om)
        gl.store(optr + 2 * Q4, a2 * inv[None, :], mask=om)
        gl.store(optr + 3 * Q4, a3 * inv[None, :], mask=om)
        gl.store(plse_ptr + prow, lse, mask=n < GQA)


def compile_decode_gluon(
    arch: int = 90,
    gqa: int = 4,
    head_dim: int = 128,
    block_n: int = 64,
    num_warps: int = 1,
    windows: bool = True,
    prefetch: bool = True,
    one_page: bool = True,
    w_tok: int = WINDOW_TOKENS_PER_PROGRAM,
    async_stages: int = 0,
    async_wide: bool = True,
    rope_pairs: int = 0,
    rope_mode: int = 1,
):
    """Compile :func:`decode_split_kernel_gluon` for ``sm_<arch>`` without a GPU (PTX and, when
    the wheel ships ``ptxas``, a cubin). For CI (syntax/layout errors) and static counts.

    The signature is specialised as the runtime specialises the benchmark shape: every
    pointer and integer divisible by 16 except the scale/zero token stride, which is 1.
    ``rope_pairs``: ``R`` of the pre-RoPE mean's score term (0: off, the pointers ``None``);
    ``rope_mode``: how the kernel computes it (``ROPE_MODE``).
    """
    if gluon is None:
        raise RuntimeError(f"triton.experimental.gluon is unavailable ({GLUON_IMPORT_ERROR})")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = decode_split_kernel_gluon
    ptr = dict.fromkeys(("kc_ptr", "vc_ptr"), "*u8")
    ptr.update(dict.fromkeys(("bt_ptr", "seqlen_ptr", "wslot_ptr"), "*i32"))
    ptr.update(dict.fromkeys(("po_ptr", "plse_ptr", "rc_ptr", "rth_ptr"), "*fp32"))
    consts = dict(
        H_KV=8,
        GQA=gqa,
        NP=max(8, triton.next_power_of_2(gqa)),
        HEAD_DIM=head_dim,
        SINK=64 if windows else 0,
        RECENT=256 if windows else 0,
        RING=256,
        BLOCK_N=block_n,
        BLOCK_W=32,
        W_TOK=w_tok,
        PREFETCH=prefetch,
        ONE_PAGE=one_page,
        PDL=arch >= 90,
        ASYNC=async_stages,
        ASYNC_WIDE=async_wide,
        num_warps=num_warps,
        ROPE_R=rope_pairs,
        ROPE_P=max(8, rope_pairs) if rope_pairs else 0,
        ROPE_MODE=rope_mode if rope_pairs else 0,
        stride_st=1,
        stride_ct=head_dim // 4,
        page_size=64,
    )
    sig, attrs = {}, {}
    if not rope_pairs:
        consts.update(rc_ptr=None, rth_ptr=None)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name == "NUM_SPLITS":
            sig[name] = "i32"
        elif name == "sm_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = ptr.get(name, "*bf16" if name.endswith("_ptr") else "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = GluonASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
