"""The window rule, the one definition every implementation uses (docs/format.md, "Windows").

A query at position ``t`` reads key ``j <= t`` from the INT2 pages iff ``sink <= j <= t - recent``,
and in BF16 otherwise: the first ``sink`` positions and the last ``recent`` positions up to and
including its own (``t - recent < j <= t``). With ``recent = 0`` every key after the sink is INT2,
the query's own included.
"""

from __future__ import annotations

import torch

__all__ = ["int2_mask", "bf16_ring_start"]


def int2_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """``[m, n]`` bool: whether the query at ``q_pos[i]`` reads key ``k_pos[j]`` from INT2.

    ``q_pos [m]``, ``k_pos [n]`` integer positions. Causality is not part of the rule (a key
    after the query is masked by the attention itself).
    """
    return (k_pos[None, :] >= sink) & (k_pos[None, :] <= q_pos[:, None] - recent)


def bf16_ring_start(t: int, sink: int, recent: int) -> int:
    """The first position after the sink that the query at ``t`` reads in BF16:
    ``max(sink, t - recent + 1)`` (positions ``[that, t]``; ``t + 1`` when ``recent = 0``)."""
    return max(sink, t - recent + 1)
