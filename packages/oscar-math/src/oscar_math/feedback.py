"""Error-feedback (LDLQ / GPTQ-style) INT2 rounding under a quadratic metric.

Plain rounding makes every coordinate's error independent, so a row's weighted error
``eᵀ M e`` (``e = x − x̂``) is about ``tr(M) · s²/12``. When ``M`` is dense and
anisotropic — the key metric ``M_K = R_Kᵀ C_Q R_K`` after the Hadamard mixing, or the
value metric ``R_Vᵀ (Σ_h W_o,hᵀ W_o,h) R_V`` — rounding the coordinates in order and
feeding each one's error forward lowers it: write ``M = Lᵀ D L`` with ``L`` unit lower
triangular, then

    eᵀ M e = Σ_j D_j (e_j + Σ_{i<j} L_ji e_i)²

and choosing ``x̂_j = Q(x_j + Σ_{i<j} L_ji e_i)`` (``Q`` rounds to the row's 4 levels and
clamps) leaves each bracket a plain rounding residual, so the error is about
``Σ_j D_j · s²/12 ≤ tr(M) · s²/12``. ``F = L − I`` (strictly lower) is the *feedback
matrix* the artifact stores. Scale, zero and clipping are exactly those of
:func:`oscar_math.quantize_int2`; only the codes change, so the stored format, the bits
per element and every decode kernel are untouched. ``F = 0`` reproduces
:func:`~oscar_math.quantize_int2` bit for bit.

Codes are computed in float32 in the order ``j = 0 .. d-1``; the running target is
updated column by column (``t[j+1:] += e_j · F[j+1:, j]``), which is what the write
kernels do.
"""

from __future__ import annotations

import torch

from .errors import check
from .pack import pack_int2
from .quantize import SCALE_DTYPE, Int2Quantized, _as_ratio, _grouped, clip_range, dequantize_int2

__all__ = [
    "feedback_matrix",
    "feedback_factors",
    "feedback_gain",
    "quantize_int2_feedback",
    "fake_quantize_int2_feedback",
]


def _damped_factor(metric: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(m, c, flip)``: the symmetrised ``metric`` (float64), the Cholesky factor ``c`` of
    ``M + δ·mean(diag M)·I`` with indices reversed (so that reversing ``c`` back gives the
    upper-triangular ``B`` of ``M = B Bᵀ``), and the reversal index."""
    m = metric.double()
    m = (m + m.transpose(-1, -2)) / 2
    d = m.shape[-1]
    diag_mean = torch.diagonal(m, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    m_damped = m + damp * diag_mean[..., None, None] * torch.eye(d, dtype=m.dtype, device=m.device)
    flip = torch.arange(d - 1, -1, -1, device=m.device)
    return m, torch.linalg.cholesky(m_damped[..., flip, :][..., :, flip]), flip


def feedback_matrix(metric: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Feedback matrix ``F = L − I`` of ``M + δ·mean(diag M)·I = Lᵀ D L``.

    Args:
        metric: ``[..., d, d]`` symmetric positive semi-definite error metric (float64
            recommended), in the basis the rows are quantised in.
        damp: relative diagonal loading ``δ`` — keeps ``L`` bounded where ``M`` is nearly
            singular (directions no query reads), as GPTQ's damping does.
    Returns:
        ``[..., d, d]`` float32, strictly lower triangular.
    """
    check(
        metric.dim() >= 2 and metric.shape[-1] == metric.shape[-2],
        "metric",
        "[..., d, d]",
        tuple(metric.shape),
    )
    check(bool(torch.isfinite(metric).all()), "metric", "finite values", "NaN/Inf")
    check(damp > 0, "damp", "> 0", damp)
    # M = B Bᵀ with B upper triangular: Cholesky of the index-reversed matrix, reversed back
    _, c, flip = _damped_factor(metric, damp)
    b = c[..., flip, :][..., :, flip]  # upper triangular, M = B Bᵀ
    lower = (b / torch.diagonal(b, dim1=-2, dim2=-1)[..., None, :]).transpose(
        -1, -2
    )  # unit lower, M = Lᵀ D L
    return torch.tril(lower, diagonal=-1).float()


def feedback_gain(metric: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Predicted error ratio ``Σ D_j / tr(M)`` of feedback over plain rounding (``[...]``).

    Idealised (uniform rounding noise, no clamping); the measured ratio is in the tests
    and docs/results.md.
    """
    m, c, _ = _damped_factor(metric, damp)
    dj = torch.diagonal(c, dim1=-2, dim2=-1).square()
    return dj.sum(-1) / torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)


def feedback_factors(metric: torch.Tensor, damp: float = 0.01) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F, w)``: the feedback matrix of :func:`feedback_matrix` and the diagonal of the
    factor, ``M + δ·mean(diag M)·I = (I + F)ᵀ diag(D) (I + F)``, as ``w = D / mean(D)``.

    ``w`` (``[..., d]`` float32, > 0) is what the scale/zero refit weighs the rounding
    residuals with (``quantize_int2_feedback(..., refit_weight=w)``); only its ratios matter.
    """
    f = feedback_matrix(metric, damp)
    _, c, flip = _damped_factor(metric, damp)
    dj = torch.diagonal(c, dim1=-2, dim2=-1).square()[..., flip]  # D_j in the original order
    return f, (dj / dj.mean(-1, keepdim=True)).float()


def quantize_int2_feedback(
    x: torch.Tensor,
    group_size: int,
    feedback: torch.Tensor | None,
    clip_ratio: float | torch.Tensor | None = None,
    refit_weight: torch.Tensor | None = None,
    refit_passes: int = 0,
) -> Int2Quantized:
    """:func:`oscar_math.quantize_int2` with error-feedback codes (and optionally refitted
    scale/zero).

    Args:
        x: ``[..., d]`` rows (centred and rotated).
        group_size: divisor of ``d``.
        feedback: ``[..., d, d]`` strictly lower triangular, broadcastable against the
            rows' leading dims (e.g. ``[H, d, d]`` for ``x [T, H, d]``); None = plain rounding.
        clip_ratio: as for :func:`~oscar_math.quantize_int2`.
        refit_weight: ``[..., d]`` positive weights ``w`` of :func:`feedback_factors`
            (broadcastable like ``feedback``); None = scale/zero as for plain rounding. When
            given (with ``feedback``), each group's scale and zero are refitted after its codes
            by weighted least squares under the metric (:func:`_refit_group`). *Research option,
            not part of the artifact format*: it lowers ``eᵀ M e`` but shrinks the rows and
            raised the end-to-end KL by 60-70 % (docs/results.md, fifth long-context study).
        refit_passes: with ``refit_weight``: how many times each group is re-rounded with
            feedback on its refitted grid and refitted again (0 = one rounding, one refit).
    Returns:
        :class:`Int2Quantized` (without refit: the scale/zero of plain rounding; only the codes differ).
    """
    check(x.is_floating_point(), "x.dtype", "a floating dtype", x.dtype)
    g = _grouped(x, group_size)
    d = x.shape[-1]
    alpha = _as_ratio(clip_ratio, x)
    lo, hi = clip_range(g.amin(-1), g.amax(-1), alpha)
    zero = lo.to(SCALE_DTYPE)
    scale = ((hi - lo) / 3.0).to(SCALE_DTYPE)
    xf = x.float()
    if feedback is None:
        check(refit_weight is None, "refit_weight", "None without feedback", "a tensor")
        s32 = scale.float()
        inv = torch.where(s32 > 0, 1.0 / torch.where(s32 > 0, s32, 1.0), torch.zeros_like(s32))
        z_el = zero.float().repeat_interleave(group_size, -1)
        i_el = inv.repeat_interleave(group_size, -1)
        codes = torch.floor((xf - z_el) * i_el + 0.5).clamp_(0, 3)
        return Int2Quantized(pack_int2(codes.to(torch.uint8)), scale, zero, group_size)
    check(feedback.shape[-2:] == (d, d), "feedback.shape[-2:]", f"({d}, {d})", tuple(feedback.shape[-2:]))
    check(
        isinstance(refit_passes, int) and refit_passes >= 0, "refit_passes", "an integer >= 0", refit_passes
    )
    f = feedback.to(xf.device, torch.float32)
    w = None
    if refit_weight is not None:
        check(refit_weight.shape[-1] == d, "refit_weight.shape[-1]", d, tuple(refit_weight.shape))
        w = refit_weight.to(xf.device, torch.float32)
    target = xf.clone()  # running targets t_j = x_j + Σ_{i<j} F_ji e_i
    codes = torch.empty_like(xf)
    s_all, z_all = scale.float().clone(), zero.float().clone()
    for grp in range(d // group_size):
        a, b = grp * group_size, (grp + 1) * group_size
        s, z = s_all[..., grp], z_all[..., grp]
        start = target.clone() if (w is not None and refit_passes > 0) else None
        for p in range(1 + (refit_passes if w is not None else 0)):
            if p > 0:
                target = start.clone()
            sums = _round_group(xf, target, codes, f, w, a, b, s, z)
            if w is not None:
                s, z = _refit_group(target, f, sums, s, z, b)
        s_all[..., grp], z_all[..., grp] = s, z
    scale_out, zero_out = (s_all.to(SCALE_DTYPE), z_all.to(SCALE_DTYPE)) if w is not None else (scale, zero)
    return Int2Quantized(pack_int2(codes.to(torch.uint8)), scale_out, zero_out, group_size)


def _round_group(
    x: torch.Tensor,
    target: torch.Tensor,
    codes: torch.Tensor,
    f: torch.Tensor,
    w: torch.Tensor | None,
    a: int,
    b: int,
    s: torch.Tensor,
    z: torch.Tensor,
) -> tuple[torch.Tensor, ...] | None:
    """Feedback-round coordinates ``a .. b-1`` (one group, grid ``s``/``z``) in place.

    With ``w``: also accumulate, in coordinate order, the weighted sums the refit needs and the
    vector ``u = Σ_{i in group} F[:, i] c_i`` (``v = Σ_{i in group} F[:, i]`` likewise, per head)
    used to re-target the later coordinates. Every float op is spelled out in a fixed order (a
    Triton version of this loop, bit-exact against it, is in commit d9ee697's ``paged_write``)."""
    d = x.shape[-1]
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, 1.0), torch.zeros_like(s))
    zeros = torch.zeros_like(s)
    spp, spq, sqq, spb, sqb = zeros, zeros, zeros, zeros, zeros
    u = torch.zeros_like(target) if w is not None else None
    v = torch.zeros_like(f[..., 0]) if w is not None else None  # [..., d] (per head)
    for j in range(a, b):
        c = torch.floor((target[..., j] - z) * inv + 0.5).clamp_(0, 3)
        codes[..., j] = c
        xhat = c * s + z
        if w is not None:
            # (L e)_j = t_j − x̂_j; (L c_g)_j = c_j + u_j; (L 1_g)_j = 1 + v_j;
            # b_j = (L e)_j + s·(L c_g)_j + z·(L 1_g)_j (the part not depending on the grid)
            pj = c + u[..., j]
            qj = 1.0 + v[..., j]
            bj = ((target[..., j] - xhat) + s * pj) + z * qj
            wj = w[..., j]
            spp = spp + (wj * pj) * pj
            spq = spq + (wj * pj) * qj
            sqq = sqq + (wj * qj) * qj
            spb = spb + (wj * pj) * bj
            sqb = sqb + (wj * qj) * bj
        if j + 1 < d:
            err = x[..., j] - xhat  # e_j = x_j − x̂_j
            col = f[..., j + 1 :, j]
            target[..., j + 1 :] += err[..., None] * col
            if w is not None:
                u[..., j + 1 :] += c[..., None] * col
                v[..., j + 1 :] += col
    if w is None:
        return None
    return spp, spq, sqq, spb, sqb, u, v


def _refit_group(
    target: torch.Tensor,
    f: torch.Tensor,
    sums: tuple[torch.Tensor, ...],
    s: torch.Tensor,
    z: torch.Tensor,
    b: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted least-squares scale/zero of one group with its codes fixed.

    Minimises ``Σ_{j in group} w_j ((L e)_j)²`` (``L = I + F``; the later groups' feedback
    compensates the rest), a 2×2 system in ``(s, z)``. bf16 is in the loop: the scale is
    rounded to bf16, the zero re-solved given it and rounded. The new pair is kept only where
    the system is regular, the scale positive and the weighted error lower; the later
    coordinates' targets are then shifted by the change of this group's errors
    (``Δe_i = −Δs·c_i − Δz``, fed forward through ``F``)."""
    spp, spq, sqq, spb, sqb, u, v = sums
    det = spp * sqq - spq * spq
    ok_det = det > 0
    safe = torch.where(ok_det, det, torch.ones_like(det))
    s_ls = (sqq * spb - spq * sqb) / safe
    s_new = s_ls.to(SCALE_DTYPE).float()
    z_new = ((sqb - s_new * spq) / torch.where(sqq > 0, sqq, torch.ones_like(sqq))).to(SCALE_DTYPE).float()
    # change of Σ w ((L e)_j)² = Σ w (b_j − s p_j − z q_j)², from the sums (no second pass)
    ds, dz = s_new - s, z_new - z
    gain = (ds * (spb - s * spp - z * spq) + dz * (sqb - s * spq - z * sqq)) * 2.0
    quad = ds * ds * spp + (ds * dz * spq) * 2.0 + dz * dz * sqq
    ok = ok_det & (sqq > 0) & (s_new > 0) & torch.isfinite(s_new) & torch.isfinite(z_new) & (quad < gain)
    s_out, z_out = torch.where(ok, s_new, s), torch.where(ok, z_new, z)
    d = target.shape[-1]
    if b < d:
        ds, dz = s_out - s, z_out - z  # zero where not ok
        target[..., b:] -= ds[..., None] * u[..., b:] + dz[..., None] * v[..., b:]
    return s_out, z_out


def fake_quantize_int2_feedback(
    x: torch.Tensor,
    group_size: int,
    feedback: torch.Tensor | None,
    clip_ratio: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode of :func:`quantize_int2_feedback`, ``[..., d]`` in ``x.dtype``."""
    return dequantize_int2(quantize_int2_feedback(x, group_size, feedback, clip_ratio), x.dtype)
