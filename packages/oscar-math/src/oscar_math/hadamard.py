"""Normalised Hadamard matrices of order ``2^m * K`` for K in {1, 12, 20, 28, 36, 40, 52, 60}.

Head dims in real models (64, 80, 96, 112, 128, 192, 256) are not all powers of two,
so a Sylvester matrix alone is not enough. Every supported order is built exactly
in integers (entries ±1, ``H Hᵀ = n I``) and only then divided by ``sqrt(n)``:

* ``n = 2^m``: Sylvester, ``H_{2n} = [[H, H], [H, -H]]``.
* otherwise ``H_{2^m} ⊗ H_K`` with a base matrix of order K:

  - Paley I (prime ``q ≡ 3 mod 4``, order ``q + 1``): 12 (q=11), 20 (q=19), 60 (q=59);
  - Paley II (``q ≡ 1 mod 4``, order ``2(q + 1)``): 28 (q=13), 36 (q=17),
    52 (q=25, with the quadratic character of GF(25) = GF(5)[x]/(x² − 2));
  - 40 = H_2 ⊗ H_20 (it is the ``m = 1, K = 20`` case of the rule above).

Writing ``n = 2^a * o`` with ``o`` odd, the base order is ``K = 4 o`` (``o`` in
{3, 5, 7, 9, 13, 15}) and ``m = a - 2``; that decomposition is unique.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

from .errors import OscarError, check

__all__ = [
    "HADAMARD_BASE_ORDERS",
    "is_hadamard_order",
    "hadamard_matrix",
    "hadamard_matrix_int",
    "random_sign_hadamard",
    "block_hadamard",
]

#: Base orders K; every order ``2^m * K`` is supported.
HADAMARD_BASE_ORDERS = (1, 12, 20, 28, 36, 40, 52, 60)

# odd part o of K = 4 o -> (field size q, Paley construction)
_BASE_BY_ODD = {3: (11, 1), 5: (19, 1), 7: (13, 2), 9: (17, 2), 13: (25, 2), 15: (59, 1)}


def _split(n: int) -> tuple[int, int] | None:
    """Return ``(2^m, K)`` with ``n = 2^m * K`` and K a base order, or None."""
    if n < 1:
        return None
    a, o = 0, n
    while o % 2 == 0:
        a, o = a + 1, o // 2
    if o == 1:
        return n, 1
    if o in _BASE_BY_ODD and a >= 2:
        return 2 ** (a - 2), 4 * o
    return None


def is_hadamard_order(n: int) -> bool:
    """True if :func:`hadamard_matrix` supports order ``n``."""
    return isinstance(n, int) and _split(n) is not None


def _field(q: int) -> tuple[list[tuple[int, int]], Callable]:
    """Elements of GF(q) (q prime or 25) as pairs ``(a, b)`` = a + b x, and subtraction."""
    if q == 25:
        p = 5
        elems = [(a, b) for b in range(p) for a in range(p)]
    else:
        p = q
        elems = [(a, 0) for a in range(p)]

    def sub(u: tuple[int, int], v: tuple[int, int]) -> tuple[int, int]:
        return ((u[0] - v[0]) % p, (u[1] - v[1]) % p)

    return elems, sub


def _squares(q: int) -> set[tuple[int, int]]:
    """Non-zero squares of GF(q); GF(25) multiplies modulo x² = 2 (2 is a non-residue mod 5)."""
    elems, _ = _field(q)
    p = 5 if q == 25 else q
    out = set()
    for a, b in elems:
        if (a, b) != (0, 0):
            # (a + b x)^2 = a² + 2ab x + b² x² = (a² + 2 b²) + 2ab x
            out.add(((a * a + 2 * b * b) % p, (2 * a * b) % p))
    return out


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = χ(e_i - e_j)``, the quadratic character of GF(q) (χ(0) = 0)."""
    elems, sub = _field(q)
    sq = _squares(q)
    Q = torch.zeros(q, q, dtype=torch.int64)
    for i, u in enumerate(elems):
        for j, v in enumerate(elems):
            if i != j:
                Q[i, j] = 1 if sub(u, v) in sq else -1
    return Q


def _paley_i(q: int) -> torch.Tensor:
    """Order q + 1 for q ≡ 3 mod 4: ``H = I + [[0, 1ᵀ], [-1, Q]]`` (Q antisymmetric)."""
    Q = _jacobsthal(q)
    S = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = Q
    return torch.eye(q + 1, dtype=torch.int64) + S


def _paley_ii(q: int) -> torch.Tensor:
    """Order 2(q + 1) for q ≡ 1 mod 4: ``C = [[0, 1ᵀ], [1, Q]]`` (symmetric), then
    0 -> [[1, -1], [-1, -1]] and ±1 -> ±[[1, 1], [1, -1]]."""
    Q = _jacobsthal(q)
    C = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    C[0, 1:] = 1
    C[1:, 0] = 1
    C[1:, 1:] = Q
    zero_block = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    sign_block = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    return torch.kron(C, sign_block) + torch.kron((C == 0).long(), zero_block)


def _sylvester(n: int) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=torch.int64)
    while H.shape[0] < n:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H


@lru_cache(maxsize=64)
def _hadamard_int_cached(n: int) -> torch.Tensor:
    split = _split(n)
    if split is None:
        raise OscarError(
            f"Invalid n: expected a Hadamard order 2^m * K with K in {HADAMARD_BASE_ORDERS} "
            f"(e.g. 64, 80, 96, 112, 128, 192, 256), got {n}"
        )
    two_m, K = split
    if K == 1:
        return _sylvester(n)
    q, kind = _BASE_BY_ODD[K // 4]
    base = _paley_i(q) if kind == 1 else _paley_ii(q)
    return torch.kron(_sylvester(two_m), base)


def hadamard_matrix_int(n: int) -> torch.Tensor:
    """Unnormalised Hadamard matrix ``[n, n]`` int64 with entries ±1 and ``H Hᵀ = n I``."""
    check(isinstance(n, int) and not isinstance(n, bool), "n", "an int", type(n).__name__)
    return _hadamard_int_cached(n).clone()


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normalised Hadamard matrix ``[n, n]`` with ``H Hᵀ = I`` (up to fp rounding).

    Supported orders: ``n = 2^m * K`` with K in :data:`HADAMARD_BASE_ORDERS`.
    Raises :class:`OscarError` otherwise.
    """
    H = hadamard_matrix_int(n).to(torch.float64) / (float(n) ** 0.5)
    return H.to(dtype)


def random_sign_hadamard(n: int, seed: int) -> torch.Tensor:
    """Seeded random-sign Hadamard ``diag(s) @ H`` ``[n, n]`` float64 (orthogonal).

    ``s`` in {-1, +1}^n comes from a ``torch.Generator`` seeded with ``seed`` so the
    same seed gives the same matrix on every machine. As a row-vector rotation
    ``x @ R = (x * s) @ H``. This is the "Hadamard-only" baseline.
    """
    check(isinstance(seed, int), "seed", "an int", type(seed).__name__)
    H = hadamard_matrix(n)
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1
    return s[:, None] * H


def block_hadamard(n: int, block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Block-diagonal Hadamard ``I_{n/block} ⊗ H_block`` ``[n, n]``.

    Mixes coordinates only inside each contiguous group of ``block`` elements (one
    quantisation group); ``block == n`` gives the full :func:`hadamard_matrix`.
    """
    check(isinstance(block, int) and block >= 1, "block", "a positive int", block)
    check(isinstance(n, int) and n >= 1 and n % block == 0, "n", f"a positive multiple of block={block}", n)
    H = hadamard_matrix(block, torch.float64)
    return torch.kron(torch.eye(n // block, dtype=torch.float64), H).to(dtype)
