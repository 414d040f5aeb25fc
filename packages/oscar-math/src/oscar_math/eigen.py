"""Eigenbasis of a covariance: float64, sorted by descending eigenvalue, fixed signs."""

from __future__ import annotations

import torch

from .errors import check

__all__ = ["eigenbasis"]


def eigenbasis(cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition ``cov = U diag(λ) Uᵀ`` in float64.

    Args:
        cov: ``[..., d, d]`` real covariance (symmetrised here: ``(C + Cᵀ) / 2``).

    Returns:
        ``(eigenvalues [..., d], U [..., d, d])`` float64; column ``U[..., :, i]`` is the
        eigenvector of ``eigenvalues[..., i]``, sorted by DESCENDING eigenvalue. Signs are
        deterministic: the largest-magnitude entry of each column (first one on ties) is
        positive, so the same covariance always gives the same rotation.
    """
    check(isinstance(cov, torch.Tensor), "cov", "a torch.Tensor", type(cov).__name__)
    check(
        cov.ndim >= 2 and cov.shape[-1] == cov.shape[-2] and cov.shape[-1] >= 1,
        "cov",
        "shape [..., d, d] (square)",
        list(cov.shape),
    )
    check(not cov.is_complex(), "cov", "a real tensor", cov.dtype)
    c = cov.to(torch.float64)
    check(bool(torch.isfinite(c).all()), "cov", "finite values", "NaN or Inf")
    c = 0.5 * (c + c.transpose(-1, -2))
    vals, vecs = torch.linalg.eigh(c)
    vals = vals.flip(-1)
    vecs = vecs.flip(-1)
    idx = vecs.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(vecs, -2, idx))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    return vals, vecs * sign
