"""Reference INT2 quantiser: asymmetric min/max per group along the head dim.

This file *is* the definition every kernel must reproduce (docs/format.md):

* Groups: a row ``x[..., d]`` (already centred and rotated) is split into
  ``d / group_size`` contiguous groups of ``group_size`` elements.
* Clipping (ratio ``alpha`` in ``(0, 1]``, calibrated offline per layer / KV head):
  with ``mn, mx`` the group's min and max,
  ``lo = alpha * mn if mn < 0 else mn`` and ``hi = alpha * mx if mx > 0 else mx``.
  It depends only on the group's own values, so prefill, decode and eviction
  paths compute the same thresholds (the reference engine used a sorted quantile
  in prefill and a bisection in decode).
* Encoding: ``zero = bf16(lo)``, ``scale = bf16((hi - lo) / 3)`` — 16 bits each,
  rounded *before* the codes are computed so codes match the stored metadata.
  ``inv = 1 / scale`` (0 where ``scale == 0``),
  ``code = clamp(floor((x - zero) * inv + 0.5), 0, 3)`` in float32.
* Decoding: ``x_hat = code * scale + zero`` in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import check
from .pack import pack_int2, unpack_int2

__all__ = [
    "SCALE_DTYPE",
    "Int2Quantized",
    "clip_range",
    "quantize_int2",
    "dequantize_int2",
    "fake_quantize_int2",
]

#: dtype of stored scale and zero (16 bits each; bf16 for fp32's exponent range).
SCALE_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Int2Quantized:
    """Packed INT2 rows.

    Attributes:
        codes: ``[..., d/4]`` uint8, strided packing (:mod:`oscar_math.pack`).
        scale: ``[..., d/group_size]`` bf16.
        zero: ``[..., d/group_size]`` bf16.
        group_size: elements per group.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int

    @property
    def head_dim(self) -> int:
        return self.codes.shape[-1] * 4


def _as_ratio(clip_ratio: float | torch.Tensor | None, ref: torch.Tensor) -> torch.Tensor:
    if clip_ratio is None:
        return torch.ones((), dtype=torch.float32, device=ref.device)
    r = torch.as_tensor(clip_ratio, dtype=torch.float32, device=ref.device)
    check(
        bool(torch.isfinite(r).all()) and bool((r > 0).all()) and bool((r <= 1).all()),
        "clip_ratio",
        "values in (0, 1]",
        r if r.numel() < 8 else f"tensor of shape {tuple(r.shape)}",
    )
    return r


def clip_range(mn: torch.Tensor, mx: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped group range.

    Args:
        mn, mx: ``[..., n_groups]`` float32 group min / max.
        alpha: ratio broadcastable to ``mn``, in ``(0, 1]``.
    Returns:
        ``(lo, hi)`` each ``[..., n_groups]`` float32.
    """
    lo = torch.where(mn < 0, mn * alpha, mn)
    hi = torch.where(mx > 0, mx * alpha, mx)
    return lo, hi


def _grouped(x: torch.Tensor, group_size: int) -> torch.Tensor:
    d = x.shape[-1]
    check(d % 4 == 0, "x.shape[-1] (head_dim)", "a multiple of 4", d)
    check(group_size > 0 and d % group_size == 0, "group_size", f"a divisor of head_dim {d}", group_size)
    return x.float().reshape(*x.shape[:-1], d // group_size, group_size)


def quantize_int2(
    x: torch.Tensor,
    group_size: int,
    clip_ratio: float | torch.Tensor | None = None,
) -> Int2Quantized:
    """Quantise rows to INT2.

    Args:
        x: ``[..., d]`` float tensor (rotated, centred keys or rotated values).
        group_size: divisor of ``d`` (32, 64 or ``d`` in practice).
        clip_ratio: ``None`` (no clipping), a float, or a tensor broadcastable to
            ``x[..., :1]`` (e.g. ``[H, 1]`` for one ratio per head of ``[T, H, d]``).
    Returns:
        :class:`Int2Quantized` with codes ``[..., d/4]`` and scale/zero ``[..., d/group_size]``.
    """
    check(x.is_floating_point(), "x.dtype", "a floating dtype", x.dtype)
    g = _grouped(x, group_size)
    # shaped like x[..., :1], the ratio broadcasts over the group axis of [..., n_groups]
    alpha = _as_ratio(clip_ratio, x)
    lo, hi = clip_range(g.amin(-1), g.amax(-1), alpha)
    zero = lo.to(SCALE_DTYPE)
    scale = ((hi - lo) / 3.0).to(SCALE_DTYPE)
    s32 = scale.float()
    inv = torch.where(s32 > 0, 1.0 / torch.where(s32 > 0, s32, 1.0), torch.zeros_like(s32))
    codes = torch.floor((g - zero.float().unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5).clamp_(0, 3)
    codes = codes.reshape(x.shape).to(torch.uint8)
    return Int2Quantized(pack_int2(codes), scale, zero, group_size)


def dequantize_int2(q: Int2Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode :class:`Int2Quantized` to ``[..., d]`` in ``dtype``."""
    codes = unpack_int2(q.codes).float()
    d = codes.shape[-1]
    g = codes.reshape(*codes.shape[:-1], d // q.group_size, q.group_size)
    out = g * q.scale.float().unsqueeze(-1) + q.zero.float().unsqueeze(-1)
    return out.reshape(codes.shape).to(dtype)


def fake_quantize_int2(
    x: torch.Tensor, group_size: int, clip_ratio: float | torch.Tensor | None = None
) -> torch.Tensor:
    """``dequantize_int2(quantize_int2(x, ...))`` in ``x.dtype``; ``[..., d]`` → ``[..., d]``."""
    return dequantize_int2(quantize_int2(x, group_size, clip_ratio), x.dtype)
