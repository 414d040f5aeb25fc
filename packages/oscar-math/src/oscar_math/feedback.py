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

__all__ = ["feedback_matrix", "feedback_gain", "quantize_int2_feedback", "fake_quantize_int2_feedback"]


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
    m = metric.double()
    m = (m + m.transpose(-1, -2)) / 2
    d = m.shape[-1]
    diag_mean = torch.diagonal(m, dim1=-2, dim2=-1).mean(-1).clamp_min(1e-30)
    m = m + damp * diag_mean[..., None, None] * torch.eye(d, dtype=m.dtype, device=m.device)
    # M = B Bᵀ with B upper triangular: Cholesky of the index-reversed matrix, reversed back
    flip = torch.arange(d - 1, -1, -1, device=m.device)
    c = torch.linalg.cholesky(m[..., flip, :][..., :, flip])
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
    m = metric.double()
    m = (m + m.transpose(-1, -2)) / 2
    d = m.shape[-1]
    tr = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)
    m = m + damp * (tr / d)[..., None, None] * torch.eye(d, dtype=m.dtype, device=m.device)
    flip = torch.arange(d - 1, -1, -1, device=m.device)
    c = torch.linalg.cholesky(m[..., flip, :][..., :, flip])
    dj = torch.diagonal(c, dim1=-2, dim2=-1).square()
    return dj.sum(-1) / tr


def quantize_int2_feedback(
    x: torch.Tensor,
    group_size: int,
    feedback: torch.Tensor | None,
    clip_ratio: float | torch.Tensor | None = None,
) -> Int2Quantized:
    """:func:`oscar_math.quantize_int2` with error-feedback codes.

    Args:
        x: ``[..., d]`` rows (centred and rotated).
        group_size: divisor of ``d``.
        feedback: ``[..., d, d]`` strictly lower triangular, broadcastable against the
            rows' leading dims (e.g. ``[H, d, d]`` for ``x [T, H, d]``); None = plain rounding.
        clip_ratio: as for :func:`~oscar_math.quantize_int2`.
    Returns:
        :class:`Int2Quantized` (same scale/zero as plain rounding; only the codes differ).
    """
    check(x.is_floating_point(), "x.dtype", "a floating dtype", x.dtype)
    g = _grouped(x, group_size)
    d = x.shape[-1]
    alpha = _as_ratio(clip_ratio, x)
    lo, hi = clip_range(g.amin(-1), g.amax(-1), alpha)
    zero = lo.to(SCALE_DTYPE)
    scale = ((hi - lo) / 3.0).to(SCALE_DTYPE)
    s32 = scale.float()
    inv = torch.where(s32 > 0, 1.0 / torch.where(s32 > 0, s32, 1.0), torch.zeros_like(s32))
    # per-element grid (each coordinate uses its own group's zero / scale)
    z_el = zero.float().repeat_interleave(group_size, -1)
    s_el = s32.repeat_interleave(group_size, -1)
    i_el = inv.repeat_interleave(group_size, -1)
    xf = x.float()
    if feedback is None:
        codes = torch.floor((xf - z_el) * i_el + 0.5).clamp_(0, 3)
    else:
        check(feedback.shape[-2:] == (d, d), "feedback.shape[-2:]", f"({d}, {d})", tuple(feedback.shape[-2:]))
        f = feedback.to(xf.device, torch.float32)
        target = xf.clone()
        codes = torch.empty_like(xf)
        for j in range(d):
            c = torch.floor((target[..., j] - z_el[..., j]) * i_el[..., j] + 0.5).clamp_(0, 3)
            codes[..., j] = c
            if j + 1 < d:
                err = xf[..., j] - (c * s_el[..., j] + z_el[..., j])  # e_j = x_j − x̂_j
                target[..., j + 1 :] += err[..., None] * f[..., j + 1 :, j]
    return Int2Quantized(pack_int2(codes.to(torch.uint8)), scale, zero, group_size)


def fake_quantize_int2_feedback(
    x: torch.Tensor,
    group_size: int,
    feedback: torch.Tensor | None,
    clip_ratio: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode of :func:`quantize_int2_feedback`, ``[..., d]`` in ``x.dtype``."""
    return dequantize_int2(quantize_int2_feedback(x, group_size, feedback, clip_ratio), x.dtype)
