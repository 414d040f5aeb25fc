"""KIVI-style INT2 reference baseline (Liu et al., 2024, "KIVI").

KIVI quantises **keys per channel** — min/max along the token axis, separately for
each channel, within blocks of ``token_group`` consecutive tokens — and **values per
token** along the head dim. Key outliers live in fixed channels, which per-channel
grouping isolates; OSCAR instead rotates them away and quantises per token, which
is what lets a decode kernel write one token at a time without re-quantising a block.

The encoding is OSCAR's (:mod:`oscar_math.quantize`): asymmetric min/max, bf16
scale and zero rounded before coding, 2-bit codes. These functions fake-quantise
(quantise then dequantise); the BF16 sink / recent windows (KIVI's full-precision
residual) are the caller's business, as for every other scheme.
"""

from __future__ import annotations

import torch

from .errors import check
from .quantize import fake_quantize_int2

__all__ = ["kivi_fake_quantize_keys", "kivi_fake_quantize_values"]


def kivi_fake_quantize_keys(
    k: torch.Tensor, token_group: int = 32, clip_ratio: float | None = None
) -> torch.Tensor:
    """Per-channel INT2 over blocks of tokens.

    Args:
        k: ``[T, H, d]`` keys (any float dtype).
        token_group: tokens per block; a final partial block of ``T % token_group``
            tokens is quantised over its own min/max.
        clip_ratio: optional clip ratio in ``(0, 1]`` (same rule as OSCAR).
    Returns:
        ``[T, H, d]`` in ``k.dtype``.
    """
    check(k.dim() == 3, "k.shape", "[T, H, d]", tuple(k.shape))
    check(k.is_floating_point(), "k.dtype", "a floating dtype", k.dtype)
    check(isinstance(token_group, int) and token_group >= 1, "token_group", "an integer >= 1", token_group)
    t = k.shape[0]
    if t == 0:
        return k.clone()
    # Put tokens last so the reference quantiser groups along them. Pad with copies of
    # the last token: a block's min/max is unchanged by repeating one of its own rows.
    # The padded length is a multiple of token_group (block alignment) and of 4 (packing).
    step = token_group * 4 // _gcd(token_group, 4)
    t_pad = -(-t // step) * step
    x = k.float().permute(1, 2, 0)  # [H, d, T]
    if t_pad > t:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], t_pad - t)], dim=-1)
    xh = fake_quantize_int2(x, token_group, clip_ratio)[..., :t]
    return xh.permute(2, 0, 1).to(k.dtype).contiguous()


def kivi_fake_quantize_values(
    v: torch.Tensor, group_size: int | None = None, clip_ratio: float | None = None
) -> torch.Tensor:
    """Per-token INT2 along the head dim (the OSCAR quantiser without rotation).

    Args:
        v: ``[..., d]`` values.
        group_size: elements per group (default ``d``).
    Returns:
        ``[..., d]`` in ``v.dtype``.
    """
    return fake_quantize_int2(v, v.shape[-1] if group_size is None else group_size, clip_ratio)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
