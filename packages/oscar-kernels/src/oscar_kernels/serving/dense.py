"""Which dense kernel an engine's prefill chunks run through: chosen once per process and geometry.

Each engine lists its candidates, best first (vLLM: its FlashAttention, then torch's; SGLang:
``sgl_kernel``'s FA3, then torch's). The first that passes
:func:`oscar_kernels.check_dense_attention` at the model's head size serves every layer of that
geometry; none passing (or ``dense_prefill`` off) leaves prefill on OSCAR's Triton extend kernel.
One start-up line says which, with the reason each refused candidate gave.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ..dense_kernels import pick_dense_attention
from ..extend_dense import DenseAttention

__all__ = ["prefill_kernel"]

log = logging.getLogger("oscar_kernels")

_CHOSEN: dict[tuple, DenseAttention | None] = {}


def prefill_kernel(
    candidates: Sequence[tuple[str, Callable[[], DenseAttention | None]]],
    device: torch.device | str,
    head_dim: int,
    kv_heads: int,
    group: int,
    dtype: torch.dtype = torch.bfloat16,
    logger: logging.Logger | None = None,
) -> DenseAttention | None:
    """The dense kernel for prefill at this geometry, or ``None`` (the Triton extend kernel).

    Checked and logged once per process for each ``(names, device, head_dim, kv_heads, group,
    dtype)``; later calls (one per attention layer) return the same choice."""
    key = (tuple(n for n, _ in candidates), str(device), head_dim, kv_heads, group, dtype)
    if key in _CHOSEN:
        return _CHOSEN[key]
    name, attn, refusals = pick_dense_attention(candidates, device, head_dim, kv_heads, group, dtype)
    why = f" ({'; '.join(refusals)})" if refusals else ""
    if name is not None:
        msg = f"OSCAR: prefill chunks through {name}, checked against its reference at start-up{why}"
    else:
        msg = f"OSCAR: prefill chunks through OSCAR's Triton extend kernel: no dense kernel passed{why}"
    (logger or log).info(msg)
    _CHOSEN[key] = attn
    return attn
