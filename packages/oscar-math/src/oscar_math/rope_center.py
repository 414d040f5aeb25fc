"""Position-dependent key centering by a pre-RoPE mean (artifact format version 3).

A static key mean is a mean of keys *after* RoPE; RoPE turns each frequency pair ``i`` of a
key by ``θ_i·p``, so the mean of the pairs whose period is comparable to the context depends
on position and a static vector cannot remove it. Centering the INT2 rows by ``RoPE_p(m)`` —
``m`` a mean of the keys *before* RoPE, non-zero only on the selected pairs — removes it::

    stored INT2 row of key p  =  Q((k_p − k_mean − RoPE_p(m)) @ R_K)
    dequantised row           =  Q⁻¹(...) + RoPE_p(m) @ R_K

BF16 window rows are unchanged (``(k_p − k_mean) @ R_K``). Attention adds the mean back as a
per-key score term: for a query ``q`` (original basis, after RoPE) and an INT2 key at
position ``p``::

    q · RoPE_p(m) = Σ_r C[0, r]·cos(p·θ_r) + C[1, r]·sin(p·θ_r),
    C[0, r] = q_i·a_r + q_{i+d/2}·b_r,   C[1, r] = q_{i+d/2}·a_r − q_i·b_r

with ``i`` the pair index of slot ``r``, ``(a_r, b_r) = (m_i, m_{i+d/2})`` and ``θ_r`` the
pair's inverse frequency. RoPE here is the rotate-half layout of HF/vLLM/SGLang llama-family
models (pair ``i`` = coordinates ``i`` and ``i + d/2``); a key's position is its index in its
sequence. Pure functions; shapes in the docstrings.
"""

from __future__ import annotations

import torch

from .errors import check

__all__ = [
    "compact_rope_mean",
    "rope_position_mean",
    "rope_rotate",
    "rope_score_coef",
    "rope_score_correction",
]


def _angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``[T, d/2]`` float64 angles ``p·θ``."""
    return positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]


def rope_rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half layout) of ``x [T, ..., d]`` at ``positions [T]``; ``inv_freq [d/2]``.

    Negative positions invert the rotation. Computed in float64, returned in ``x.dtype``.
    """
    d = x.shape[-1]
    check(inv_freq.shape == (d // 2,), "shape of inv_freq", (d // 2,), tuple(inv_freq.shape))
    check(positions.shape == (x.shape[0],), "shape of positions", (x.shape[0],), tuple(positions.shape))
    ang = _angles(positions.to(x.device), inv_freq.to(x.device))
    ang = torch.cat((ang, ang), dim=-1).reshape(x.shape[0], *([1] * (x.dim() - 2)), d)
    xd = x.double()
    half = d // 2
    rotated = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)
    return (xd * ang.cos() + rotated * ang.sin()).to(x.dtype)


def rope_position_mean(mean: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """``RoPE_p(m)`` for every position: ``mean [H, d]`` → ``[T, H, d]`` float32."""
    m = mean.double()[None].expand(positions.shape[0], *mean.shape)
    return rope_rotate(m, positions, inv_freq).float()


def compact_rope_mean(
    mean: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selected pairs of a dense pre-RoPE mean, padded to a power of two for the kernels.

    Args:
        mean: ``[H, d]`` dense pre-RoPE mean, zero outside the selected pairs.
        inv_freq: ``[d/2]`` RoPE inverse frequencies.
    Returns:
        ``(ab [H, 2, R], theta [R], pairs [R])``: float32 ``(a_r, b_r)`` per head, float32
        ``θ_r`` and int64 pair indices; ``R`` = the next power of two ≥ the number of pairs
        that are non-zero in any head (at least 1). Padding slots have ``a = b = θ = 0`` and
        pair index 0 (they add nothing).
    """
    h, d = mean.shape
    half = d // 2
    check(inv_freq.shape == (half,), "shape of inv_freq", (half,), tuple(inv_freq.shape))
    nz = (mean[:, :half] != 0) | (mean[:, half:] != 0)
    pairs = torch.nonzero(nz.any(0)).flatten().cpu()
    n = max(1, int(pairs.numel()))
    r = 1 << (n - 1).bit_length()
    idx = torch.zeros(r, dtype=torch.int64)
    idx[: pairs.numel()] = pairs
    ab = torch.zeros(h, 2, r, dtype=torch.float32, device=mean.device)
    theta = torch.zeros(r, dtype=torch.float32, device=mean.device)
    k = pairs.numel()
    if k:
        sel = pairs.to(mean.device)
        ab[:, 0, :k] = mean[:, sel].float()
        ab[:, 1, :k] = mean[:, sel + half].float()
        theta[:k] = inv_freq.to(mean.device)[sel].float()
    return ab, theta, idx.to(mean.device)


def rope_score_coef(q: torch.Tensor, ab: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Per-query coefficients ``C`` of the score term (module doc).

    Args:
        q: ``[..., H_q, d]`` queries in the original basis (after RoPE); ``H_q = g·H_kv``,
            query head ``h`` reads KV head ``h // g``.
        ab: ``[H_kv, 2, R]``; pairs: ``[R]`` (from :func:`compact_rope_mean`).
    Returns:
        ``[..., H_q, 2, R]`` float32.
    """
    hq, d = q.shape[-2], q.shape[-1]
    hkv = ab.shape[0]
    check(hq % hkv == 0, "query heads", f"a multiple of {hkv}", hq)
    half = d // 2
    qf = q.float()
    qa = qf[..., pairs]  # [..., H_q, R]
    qb = qf[..., pairs + half]
    a = ab[:, 0].repeat_interleave(hq // hkv, 0)  # [H_q, R]
    b = ab[:, 1].repeat_interleave(hq // hkv, 0)
    return torch.stack((qa * a + qb * b, qb * a - qa * b), dim=-2)


def rope_score_correction(coef: torch.Tensor, theta: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``q · RoPE_p(m)`` for every position: ``coef [..., 2, R]``, ``positions [N]`` → ``[..., N]``.

    Float64 angles (the reference the kernels are tested against), float32 result.
    """
    ang = _angles(positions, theta)  # [N, R]
    c = coef.double()
    out = c[..., 0, None, :] * ang.cos() + c[..., 1, None, :] * ang.sin()  # [..., N, R]
    return out.sum(-1).float()
