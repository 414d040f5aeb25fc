"""Bit-reversal permutation of eigen-directions into quantisation groups.

Eigen-directions are indexed by importance (0 = largest eigenvalue). With
``n_groups = d / group_size`` groups, direction ``i`` goes to

* group ``bitrev(i mod n_groups)`` (bit reversal over ``log2(n_groups)`` bits when
  ``n_groups`` is a power of two, plain round-robin ``i mod n_groups`` otherwise),
* slot ``i // n_groups`` inside that group,

i.e. output position ``group * group_size + slot``. Each consecutive block of
``n_groups`` directions (similar eigenvalues) is spread one per group, so every
group gets a balanced mix of high- and low-importance directions. For a power-of-two
``d`` this places directions exactly as the full ``log2(d)``-bit reversal does up to
the order of slots inside a group (which a group-wise Hadamard mixes anyway).

Convention: ``perm[j]`` is the eigen-direction placed at output position ``j``, so
``x_perm = x[..., perm]`` and, with ``P = permutation_matrix(perm)``
(``P[perm[j], j] = 1``), ``x @ P == x[..., perm]`` and ``U @ P == U[:, perm]``.
"""

from __future__ import annotations

import torch

from .errors import check

__all__ = ["bit_reverse", "bit_reversal_permutation", "permutation_matrix", "inverse_permutation"]


def bit_reverse(i: int, bits: int) -> int:
    """Reverse the lowest ``bits`` bits of ``i``."""
    out = 0
    for _ in range(bits):
        out = (out << 1) | (i & 1)
        i >>= 1
    return out


def bit_reversal_permutation(d: int, group_size: int) -> torch.Tensor:
    """Permutation ``perm`` ``[d]`` int64 of eigen-directions into quantisation groups.

    ``perm[j]`` = the eigen-direction (0 = largest eigenvalue) placed at output
    position ``j``; use ``x[..., perm]`` or ``x @ permutation_matrix(perm)``.
    ``group_size == d`` gives the identity.
    """
    check(isinstance(d, int) and d >= 1, "d", "a positive int", d)
    check(
        isinstance(group_size, int) and group_size >= 1 and d % group_size == 0,
        "group_size",
        f"a positive divisor of d={d}",
        group_size,
    )
    n_groups = d // group_size
    power_of_two = n_groups & (n_groups - 1) == 0
    bits = n_groups.bit_length() - 1
    perm = torch.empty(d, dtype=torch.int64)
    for i in range(d):
        r = i % n_groups
        group = bit_reverse(r, bits) if power_of_two else r
        perm[group * group_size + i // n_groups] = i
    return perm


def permutation_matrix(perm: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Matrix ``P`` ``[d, d]`` with ``P[perm[j], j] = 1``, so ``x @ P == x[..., perm]``."""
    check(perm.ndim == 1, "perm", "a 1-D tensor", tuple(perm.shape))
    d = perm.shape[0]
    check(
        torch.equal(torch.sort(perm.long()).values, torch.arange(d)),
        "perm",
        f"a permutation of 0..{d - 1}",
        perm.tolist(),
    )
    P = torch.zeros(d, d, dtype=dtype)
    P[perm.long(), torch.arange(d)] = 1
    return P


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` ``[d]`` with ``x[..., perm][..., inv] == x``."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.shape[0], dtype=perm.dtype)
    return inv
