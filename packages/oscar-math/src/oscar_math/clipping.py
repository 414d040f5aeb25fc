"""Calibrated clipping: choose each layer's (and KV head's) clip ratio offline.

Parametrisation (the artifact contract, :mod:`oscar_math.quantize`): one ratio
``alpha`` in ``(0, 1]`` per layer, or per KV head, for keys and one for values.
Each quantisation group of a row shrinks its own range,
``lo = alpha * min`` (if ``min < 0``) and ``hi = alpha * max`` (if ``max > 0``),
so the threshold depends only on the row being written and every write path
(prefill, decode, window eviction) computes the same thing.

The ratio minimises an *attention-aware* error on rotated calibration samples
``x[N, G, d]`` (``G`` = 1 per layer or ``num_kv_heads``), averaged over samples::

    error_g(alpha) = (1/N) * sum_n  w[n, g] * e[n, g]ᵀ M[g] e[n, g]
    e[n, g]        = x[n, g] - fake_quantize_int2(x[n, g], group_size, alpha)

* **Keys**: ``M = R_Kᵀ C_Q R_K`` — the query covariance of the KV head's query
  group, expressed in the rotated basis — and ``w = 1``. Then ``eᵀ M e`` is the
  expected squared logit error ``E_q[(qᵀ(k − k̂))²]`` over the calibration queries.
  Keys are centred before rotation: ``x = (k − k_mean) @ R_K`` (see :func:`center_keys`);
  the search must see the same centred rows the cache will store.
* **Values**: ``M = I`` and ``w[n] = Σ_t S[t, n]²`` (the diagonal of ``SᵀS``, the
  attention weight the cached value ``n`` receives, pooled over the query heads of
  its group; supplied by the caller, e.g. from the same blockwise softmax pass that
  accumulates ``C_S``). This is the **diagonal approximation** of the output error
  ``‖S (V − V̂)‖²_F = Σ_{n,m} (SᵀS)[n, m] e_nᵀ e_m``: it drops the cross terms
  between different value rows, whose quantisation errors are nearly uncorrelated.

Because ``alpha = 1`` is always in the grid, the calibrated ratio never does worse
than "no clipping" on the calibration data; whether it generalises is measured on
held-out rows (tests, and the evaluation harness).

:func:`quantile_clip_fake_quantize` is the published reference engine's runtime rule
(clamp each row at a magnitude quantile, 0.96 for K / 0.92 for V), kept only as a
baseline to compare against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .errors import check
from .quantize import SCALE_DTYPE, clip_range, fake_quantize_int2

__all__ = [
    "ClipSearch",
    "DEFAULT_CLIP_GRID",
    "FINE_CLIP_GRID",
    "center_keys",
    "rotate_samples",
    "key_metric",
    "quantization_error",
    "clip_error",
    "search_clip_ratio",
    "quantile_clip_fake_quantize",
]

#: default search grid: 0.50, 0.55, ..., 1.00, refined by golden-section search around the best
#: (10 steps: the ratio is resolved to about 0.001 with ~23 error evaluations).
DEFAULT_CLIP_GRID = tuple(round(0.5 + 0.05 * i, 2) for i in range(11))
#: exhaustive grid 0.50, 0.51, ..., 1.00 (slower; for studies of the error curve).
FINE_CLIP_GRID = tuple(round(0.5 + 0.01 * i, 2) for i in range(51))

_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class ClipSearch:
    """Result of :func:`search_clip_ratio`.

    Attributes:
        ratios: ``[G]`` float32, the chosen clip ratio per group of samples, in ``(0, 1]``.
        grid: ``[K]`` float32, the ratios evaluated on the grid.
        errors: ``[K, G]`` float64, error at each grid ratio.
        error: ``[G]`` float64, error at ``ratios`` (never above ``error_unclipped``).
        error_unclipped: ``[G]`` float64, error at ``alpha = 1``.
    """

    ratios: torch.Tensor
    grid: torch.Tensor
    errors: torch.Tensor
    error: torch.Tensor
    error_unclipped: torch.Tensor


def center_keys(k: torch.Tensor, k_mean: torch.Tensor | None) -> torch.Tensor:
    """Subtract the calibrated key mean (original, un-rotated basis) before rotation.

    Softmax ignores a constant added to all of one query's logits, so
    ``q·(k − μ)`` needs no correction at run time while the quantiser sees rows
    without their shared offset.

    Args:
        k: ``[..., G, d]`` keys (after RoPE), ``G`` = 1 or ``num_kv_heads``.
        k_mean: ``[G, d]`` or ``[d]``; ``None`` returns ``k`` unchanged.
    Returns:
        ``[..., G, d]``.
    """
    if k_mean is None:
        return k
    check(
        k_mean.dim() in (1, 2) and tuple(k_mean.shape) == tuple(k.shape[-k_mean.dim() :]),
        "k_mean.shape",
        f"[d] or [G, d] matching the trailing dims of k {tuple(k.shape)}",
        tuple(k_mean.shape),
    )
    return k - k_mean.to(k.dtype)


def rotate_samples(x: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Rows as the cache stores them: ``(x − mean) @ R`` per KV head.

    Args:
        x: ``[N, H, d]`` keys (after RoPE) or values of ``H`` KV heads.
        rotation: ``[G, d, d]`` with ``G`` = 1 (one per layer) or ``H`` (per KV head).
        mean: ``None`` or ``[G, d]`` key mean in the original basis (keys only).
    Returns:
        ``[N, H, d]`` float32. For a per-layer clip ratio search pool the heads:
        ``rotate_samples(...).reshape(-1, 1, d)``.
    """
    check(x.dim() == 3, "x.shape", "[N, H, d]", tuple(x.shape))
    n, h, d = x.shape
    check(
        rotation.dim() == 3 and rotation.shape[0] in (1, h) and tuple(rotation.shape[1:]) == (d, d),
        "rotation.shape",
        f"[1, {d}, {d}] or [{h}, {d}, {d}]",
        tuple(rotation.shape),
    )
    xf = x.float()
    if mean is not None:
        check(
            mean.dim() == 2 and mean.shape[0] == rotation.shape[0] and mean.shape[1] == d,
            "mean.shape",
            f"[{rotation.shape[0]}, {d}]",
            tuple(mean.shape),
        )
        xf = xf - mean.float()
    r = rotation.float().expand(h, d, d)
    return torch.bmm(xf.transpose(0, 1), r).transpose(0, 1)


def key_metric(query_covariance: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Key error metric in the rotated basis, ``Rᵀ C_Q R``.

    With ``k_rot = (k − μ) @ R`` and ``q_rot = q @ R``, the expected squared logit error
    over queries is ``e_rotᵀ (Rᵀ C_Q R) e_rot``.

    Args:
        query_covariance: ``[G, d, d]`` (``oscar_math.QueryCovariance`` result).
        rotation: ``[G, d, d]``.
    Returns:
        ``[G, d, d]`` float32.
    """
    check(
        query_covariance.shape == rotation.shape and rotation.dim() == 3,
        "query_covariance.shape",
        f"equal to rotation.shape {tuple(rotation.shape)}",
        tuple(query_covariance.shape),
    )
    r = rotation.double()
    return (r.transpose(-1, -2) @ query_covariance.double() @ r).float()


def _check_samples(x: torch.Tensor, group_size: int) -> None:
    check(x.dim() == 3, "x.shape", "[N, G, d]", tuple(x.shape))
    check(x.is_floating_point(), "x.dtype", "a floating dtype", x.dtype)
    check(x.shape[0] >= 1, "x.shape[0] (N)", ">= 1 sample", x.shape[0])
    d = x.shape[-1]
    check(d % 4 == 0, "x.shape[-1] (head_dim)", "a multiple of 4", d)
    ok = isinstance(group_size, int) and group_size > 0 and d % group_size == 0
    check(ok, "group_size", f"a divisor of head_dim {d}", group_size)


def _prep_metric(metric: torch.Tensor | None, g: int, d: int) -> torch.Tensor | None:
    if metric is None:
        return None
    m = metric.to(torch.float32)
    if m.dim() == 2 and tuple(m.shape) == (d, d):
        m = m.unsqueeze(0).expand(g, d, d)
    check(tuple(m.shape) == (g, d, d), "metric.shape", f"[{d}, {d}] or [{g}, {d}, {d}]", tuple(metric.shape))
    check(bool(torch.isfinite(m).all()), "metric", "finite values", "NaN/Inf")
    return m


def _prep_weights(weights: torch.Tensor | None, n: int, g: int) -> torch.Tensor | None:
    if weights is None:
        return None
    w = weights.to(torch.float64)
    if w.dim() == 1:
        w = w.unsqueeze(1)
    check(
        w.shape[0] == n and w.shape[1] in (1, g) and w.dim() == 2,
        "weights.shape",
        f"[{n}] or [{n}, {g}]",
        tuple(weights.shape),
    )
    check(
        bool(torch.isfinite(w).all()) and bool((w >= 0).all()),
        "weights",
        "finite values >= 0",
        "negative or NaN/Inf",
    )
    return w.expand(n, g)


def _weighted_quadratic(e: torch.Tensor, m: torch.Tensor | None, w: torch.Tensor | None) -> torch.Tensor:
    """``(1/N) Σ_n w[n,g] e[n,g]ᵀ M[g] e[n,g]`` for ``e[N, G, d]`` → ``[G]`` float64."""
    if m is None:
        q = e.square().sum(-1)
    else:
        em = torch.bmm(e.transpose(0, 1), m)  # [G, N, d]
        q = (em * e.transpose(0, 1)).sum(-1).transpose(0, 1)  # [N, G]
    q = q.to(torch.float64)
    if w is not None:
        q = q * w
    return q.mean(0)


def quantization_error(
    x: torch.Tensor,
    x_hat: torch.Tensor,
    *,
    metric: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention-aware error of any reconstruction ``x_hat`` of ``x`` (see module docstring).

    Args:
        x, x_hat: ``[N, G, d]``.
        metric: ``None`` (identity), ``[d, d]`` or ``[G, d, d]`` PSD matrix ``M``.
        weights: ``None``, ``[N]`` or ``[N, G]`` non-negative sample weights ``w``.
    Returns:
        ``[G]`` float64, ``(1/N) Σ_n w_n e_nᵀ M e_n``.
    """
    check(x.dim() == 3, "x.shape", "[N, G, d]", tuple(x.shape))
    check(x_hat.shape == x.shape, "x_hat.shape", str(tuple(x.shape)), tuple(x_hat.shape))
    n, g, d = x.shape
    e = x.float() - x_hat.float()
    return _weighted_quadratic(e, _prep_metric(metric, g, d), _prep_weights(weights, n, g))


class _Quantiser:
    """Fake-quantises ``x[N, G, d]`` for many ratios, reusing the group min/max.

    Bit-for-bit the arithmetic of :func:`oscar_math.quantize.quantize_int2` followed by
    dequantisation (tested), without packing codes into bytes.
    """

    def __init__(self, x: torch.Tensor, group_size: int):
        n, g, d = x.shape
        self.shape = x.shape
        self.x = x.float()
        self.grouped = self.x.reshape(n, g, d // group_size, group_size)
        self.mn = self.grouped.amin(-1)
        self.mx = self.grouped.amax(-1)

    def error(self, alpha: torch.Tensor, m: torch.Tensor | None, w: torch.Tensor | None) -> torch.Tensor:
        """``alpha[G]`` → error ``[G]`` float64."""
        a = alpha.to(torch.float32).view(1, -1, 1)
        lo, hi = clip_range(self.mn, self.mx, a)
        zero = lo.to(SCALE_DTYPE).float()
        scale = ((hi - lo) / 3.0).to(SCALE_DTYPE).float()
        inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), torch.zeros_like(scale))
        # in place, one buffer: codes -> x_hat -> (x_hat - x); the sign of e is irrelevant
        t = self.grouped - zero.unsqueeze(-1)
        t.mul_(inv.unsqueeze(-1)).add_(0.5).floor_().clamp_(0, 3)
        t.mul_(scale.unsqueeze(-1)).add_(zero.unsqueeze(-1)).sub_(self.grouped)
        e = t.reshape(self.shape)
        return _weighted_quadratic(e, m, w)


def _ratio_tensor(alpha: float | torch.Tensor, g: int) -> torch.Tensor:
    a = torch.as_tensor(alpha, dtype=torch.float32).reshape(-1)
    check(a.numel() in (1, g), "alpha", f"a float or a [{g}] tensor", tuple(a.shape))
    ok = bool(torch.isfinite(a).all()) and bool((a > 0).all()) and bool((a <= 1).all())
    check(ok, "alpha", "values in (0, 1]", a.tolist())
    return a.expand(g).clone()


def clip_error(
    x: torch.Tensor,
    group_size: int,
    alpha: float | torch.Tensor,
    *,
    metric: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention-aware error of INT2 with clip ratio ``alpha``.

    Args:
        x: ``[N, G, d]`` rotated (keys: centred, then rotated) samples.
        group_size: divisor of ``d``.
        alpha: a ratio in ``(0, 1]`` or ``[G]`` ratios (one per sample group).
        metric: ``None``, ``[d, d]`` or ``[G, d, d]`` (keys: ``R_Kᵀ C_Q R_K``).
        weights: ``None``, ``[N]`` or ``[N, G]`` (values: attention weight ``Σ_t S_tn²``).
    Returns:
        ``[G]`` float64.
    """
    _check_samples(x, group_size)
    n, g, d = x.shape
    m, w = _prep_metric(metric, g, d), _prep_weights(weights, n, g)
    return _Quantiser(x, group_size).error(_ratio_tensor(alpha, g), m, w)


def search_clip_ratio(
    x: torch.Tensor,
    group_size: int,
    *,
    metric: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    grid: torch.Tensor | tuple[float, ...] | list[float] | None = None,
    refine_steps: int = 10,
) -> ClipSearch:
    """Choose the clip ratio per sample group ``g`` that minimises :func:`clip_error`.

    Evaluates every ratio of ``grid`` (default :data:`DEFAULT_CLIP_GRID`; 1.0 is always
    added), then runs ``refine_steps`` golden-section steps inside one grid step either
    side of each group's best ratio and keeps the refined ratio only where it is lower.

    Args:
        x: ``[N, G, d]`` rotated calibration samples (``G`` = 1 per layer, or per KV head).
        group_size: quantisation group size, a divisor of ``d``.
        metric, weights: as in :func:`clip_error`.
        grid: ratios in ``(0, 1]``.
    Returns:
        :class:`ClipSearch`.
    """
    _check_samples(x, group_size)
    n, g, d = x.shape
    m, w = _prep_metric(metric, g, d), _prep_weights(weights, n, g)
    gr = torch.as_tensor(DEFAULT_CLIP_GRID if grid is None else grid, dtype=torch.float32).reshape(-1)
    ok = gr.numel() > 0 and bool(torch.isfinite(gr).all()) and bool((gr > 0).all()) and bool((gr <= 1).all())
    check(ok, "grid", "a non-empty list of ratios in (0, 1]", gr.tolist()[:8])
    gr = torch.unique(torch.cat([gr, torch.ones(1)]))  # sorted; alpha = 1 always present
    quant = _Quantiser(x, group_size)
    errors = torch.stack([quant.error(a.expand(g), m, w) for a in gr])  # [K, G]
    best = errors.argmin(0)
    ratios = gr[best].clone()
    err = errors[best, torch.arange(g)].clone()
    if refine_steps > 0 and gr.numel() > 1:
        step = float((gr[1:] - gr[:-1]).max()) if gr.numel() > 1 else 0.0
        lo = (ratios - step).clamp(min=float(gr[0]) * 0.5)
        hi = (ratios + step).clamp(max=1.0)
        # golden-section search per group (vectorised over G); error is only piecewise smooth
        # in alpha (rounding), so we keep the refined point only where it really is lower
        c = hi - _GOLDEN * (hi - lo)
        e_ = lo + _GOLDEN * (hi - lo)
        fc, fe = quant.error(c, m, w), quant.error(e_, m, w)
        for _ in range(refine_steps):
            left = fc < fe
            hi = torch.where(left, e_, hi)
            lo = torch.where(left, lo, c)
            new_c = hi - _GOLDEN * (hi - lo)
            new_e = lo + _GOLDEN * (hi - lo)
            c, e_ = torch.where(left, new_c, e_), torch.where(left, c, new_e)
            f_new = quant.error(torch.where(left, c, e_), m, w)
            fc, fe = torch.where(left, f_new, fe), torch.where(left, fc, f_new)
        cand = torch.where(fc < fe, c, e_)
        f_cand = torch.minimum(fc, fe)
        better = f_cand < err
        ratios = torch.where(better, cand, ratios)
        err = torch.where(better, f_cand, err)
    return ClipSearch(
        ratios=ratios.to(torch.float32),
        grid=gr,
        errors=errors,
        error=err,
        error_unclipped=errors[-1].clone(),
    )


def quantile_clip_fake_quantize(x: torch.Tensor, group_size: int, quantile: float) -> torch.Tensor:
    """Baseline only: the reference engine's runtime clip, then INT2.

    Each row ``x[..., d]`` is clamped to ``±t`` where ``t`` is the ``quantile`` of
    ``|x|`` over the row (nearest rank: the ``ceil(quantile * d)``-th smallest), then
    quantised without further clipping. The reference uses 0.96 for keys and 0.92
    for values, the same for every layer and head.

    Args:
        x: ``[..., d]``.
        group_size: divisor of ``d``.
        quantile: in ``(0, 1]``.
    Returns:
        ``[..., d]`` in ``x.dtype``.
    """
    check(0 < quantile <= 1, "quantile", "a value in (0, 1]", quantile)
    d = x.shape[-1]
    k = max(1, math.ceil(quantile * d))
    t = x.float().abs().kthvalue(k, dim=-1, keepdim=True).values
    clamped = torch.maximum(torch.minimum(x.float(), t), -t)
    return fake_quantize_int2(clamped, group_size).to(x.dtype)
