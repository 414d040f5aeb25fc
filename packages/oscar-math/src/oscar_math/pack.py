"""Packing of 2-bit codes, four per byte, in the *strided* row layout.

For a row of ``d`` codes (``d % 4 == 0``), byte ``b`` (``0 <= b < d/4``) holds the
codes of elements ``b + i * d/4`` for ``i = 0..3`` in bits ``2i..2i+1``::

    byte[b] = c[b] | c[b + d/4] << 2 | c[b + d/2] << 4 | c[b + 3d/4] << 6

Why strided rather than adjacent: a kernel that loads the ``d/4`` bytes of a row
unpacks them into four *contiguous* quarter-rows with one shift and mask each, so it
can multiply each quarter by the matching quarter of the query without any
interleaving (see docs/format.md).
"""

from __future__ import annotations

import torch

from .errors import check

__all__ = ["pack_int2", "unpack_int2"]


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """Pack 2-bit codes.

    Args:
        codes: ``[..., d]`` integer tensor with values in ``0..3``, ``d % 4 == 0``.
    Returns:
        ``[..., d/4]`` uint8.
    """
    d = codes.shape[-1]
    check(d % 4 == 0, "codes.shape[-1]", "a multiple of 4", d)
    c = codes.to(torch.uint8)
    q = d // 4
    return c[..., :q] | (c[..., q : 2 * q] << 2) | (c[..., 2 * q : 3 * q] << 4) | (c[..., 3 * q :] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int2`.

    Args:
        packed: ``[..., d/4]`` uint8.
    Returns:
        ``[..., d]`` uint8 codes in ``0..3``.
    """
    check(packed.dtype == torch.uint8, "packed.dtype", "torch.uint8", packed.dtype)
    parts = [(packed >> (2 * i)) & 3 for i in range(4)]
    return torch.cat(parts, dim=-1)
