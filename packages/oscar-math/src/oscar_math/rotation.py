"""Rotation composition ``R = U · P_br · H_blk`` and the baseline rotations.

Convention: rotations act on ROW vectors, ``x_rot = x @ R`` (``x [..., d]``), and the
inverse is ``x = x_rot @ Rᵀ``. Column ``j`` of ``R`` is the direction whose
coefficient lands in output coordinate ``j``.
"""

from __future__ import annotations

from enum import Enum

import torch

from .bitrev import bit_reversal_permutation
from .errors import check
from .hadamard import block_hadamard, hadamard_matrix, random_sign_hadamard

__all__ = [
    "HadamardMode",
    "compose_rotation",
    "identity_rotation",
    "hadamard_rotation",
    "is_orthogonal",
]


class HadamardMode(str, Enum):
    """Which Hadamard follows the eigenbasis and the permutation."""

    GROUP = "group"  # I_{d/group} ⊗ H_group: mix inside each quantisation group (default)
    FULL = "full"  # the full H_d (ablation)
    NONE = "none"  # no Hadamard (eigenbasis + permutation only)


def compose_rotation(
    U: torch.Tensor,
    group_size: int,
    *,
    bit_reversal: bool = True,
    hadamard: str | HadamardMode = "group",
) -> torch.Tensor:
    """Compose the OSCAR rotation ``R = U · P_br · H_blk`` ``[..., d, d]`` float64.

    ``x @ R`` first projects ``x`` on the eigenbasis (columns of ``U`` sorted by
    descending eigenvalue, :func:`oscar_math.eigen.eigenbasis`), then permutes the
    eigen-directions into quantisation groups by bit reversal
    (:func:`oscar_math.bitrev.bit_reversal_permutation`, ``U · P == U[..., :, perm]``),
    then applies a Hadamard inside each group of ``group_size`` coordinates
    (``block_hadamard(d, group_size)``; the full ``H_d`` when ``group_size == d``).

    Why this order: after a full ``d × d`` Hadamard every output coordinate already
    carries energy ``Σλ / d``, so a permutation placed after it changes nothing. It is
    the permutation of eigen-directions *before* a group-wise Hadamard that gives every
    group a balanced mix of high- and low-eigenvalue directions; the Hadamard then
    spreads each group's energy evenly over its coordinates (``diag(Hᵀ Λ_g H) =
    mean(Λ_g)``), so min/max quantisation sees no outlier coordinate. This is the
    OSCAR paper's (arXiv 2605.17757) ``R = U·H·P`` (docs/math.md) written for row
    vectors with ``P`` acting on eigen-directions. With ``group_size == d`` the permutation is the identity.

    Args:
        U: ``[..., d, d]`` orthogonal eigenbasis, columns sorted by descending eigenvalue.
        group_size: quantisation group size; must divide ``d`` and be a Hadamard order
            when ``hadamard="group"``.
        bit_reversal: permute eigen-directions into groups (``False``: keep eigen order,
            so group 0 holds the top ``group_size`` directions).
        hadamard: ``"group"`` (default), ``"full"`` (``H_d`` after ``P``, ablation)
            or ``"none"``.

    Returns:
        ``R`` ``[..., d, d]`` float64, orthogonal if ``U`` is.
    """
    check(isinstance(U, torch.Tensor), "U", "a torch.Tensor", type(U).__name__)
    check(
        U.ndim >= 2 and U.shape[-1] == U.shape[-2] and U.shape[-1] >= 1,
        "U",
        "shape [..., d, d] (square)",
        list(U.shape),
    )
    d = U.shape[-1]
    check(
        isinstance(group_size, int) and group_size >= 1 and d % group_size == 0,
        "group_size",
        f"a positive divisor of d={d}",
        group_size,
    )
    modes = [m.value for m in HadamardMode]
    check(
        isinstance(hadamard, str) and str(getattr(hadamard, "value", hadamard)) in modes,
        "hadamard",
        f"one of {modes}",
        hadamard,
    )
    mode = HadamardMode(hadamard)
    R = U.to(torch.float64)
    if bit_reversal:
        perm = bit_reversal_permutation(d, group_size).to(R.device)
        R = R[..., :, perm]
    if mode is HadamardMode.GROUP:
        R = R @ block_hadamard(d, group_size).to(R.device)
    elif mode is HadamardMode.FULL:
        R = R @ hadamard_matrix(d).to(R.device)
    return R


def identity_rotation(d: int) -> torch.Tensor:
    """Identity ``[d, d]`` float64 (no rotation baseline)."""
    check(isinstance(d, int) and d >= 1, "d", "a positive int", d)
    return torch.eye(d, dtype=torch.float64)


def hadamard_rotation(d: int, seed: int) -> torch.Tensor:
    """Seeded random-sign Hadamard ``[d, d]`` float64 (the "Hadamard-only" baseline)."""
    return random_sign_hadamard(d, seed)


def is_orthogonal(R: torch.Tensor, atol: float = 1e-5) -> bool:
    """True if ``R`` ``[..., d, d]`` is square, finite and ``|R Rᵀ - I| <= atol`` everywhere."""
    if not isinstance(R, torch.Tensor) or R.ndim < 2 or R.shape[-1] != R.shape[-2]:
        return False
    r = R.to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        return False
    eye = torch.eye(r.shape[-1], dtype=torch.float64, device=r.device)
    return bool(((r @ r.transpose(-1, -2)) - eye).abs().max() <= atol) if r.numel() else True
