"""``torch.library`` registration of decode attention (``torch.ops.oscar.decode_attention``).

A custom op with a fake (meta) implementation lets ``torch.compile`` trace through the
attention call and keeps it one opaque node in a captured graph. Tensors only: the
cache is passed as its eleven tensors and the layout as integers; the pre-RoPE key mean's
tensors (``ExpandedParams.k_rope_*``, format version 3) as optional tensors (``None``: off).
Registered on first call of :func:`register_ops` (no import side effects).
"""

from __future__ import annotations

import functools

import torch

from .layout import CacheLayout, PagedKVCache
from .params import ExpandedParams

__all__ = ["register_ops", "decode_attention_op"]


@functools.lru_cache(maxsize=1)
def register_ops() -> None:
    """Register ``oscar::decode_attention`` and its fake twin (idempotent)."""

    @torch.library.custom_op("oscar::decode_attention", mutates_args=())
    def _decode(
        q: torch.Tensor,
        k_codes: torch.Tensor,
        v_codes: torch.Tensor,
        k_scale: torch.Tensor,
        k_zero: torch.Tensor,
        v_scale: torch.Tensor,
        v_zero: torch.Tensor,
        k_sink: torch.Tensor,
        v_sink: torch.Tensor,
        k_recent: torch.Tensor,
        v_recent: torch.Tensor,
        k_rotation: torch.Tensor,
        v_rotation: torch.Tensor,
        k_mean: torch.Tensor,
        k_clip: torch.Tensor,
        v_clip: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        window_slots: torch.Tensor,
        group_size: int,
        softmax_scale: float,
        k_rope_mean: torch.Tensor | None = None,
        k_rope_inv_freq: torch.Tensor | None = None,
        k_rope_ab: torch.Tensor | None = None,
        k_rope_theta: torch.Tensor | None = None,
        k_rope_pairs: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from .decode_attention import decode_attention

        h, ps, d = k_codes.shape[1], k_codes.shape[2], q.shape[-1]
        lo = CacheLayout(h, d, ps, group_size, k_sink.shape[2], k_recent.shape[2])
        cache = PagedKVCache(
            lo, k_codes, v_codes, k_scale, k_zero, v_scale, v_zero, k_sink, v_sink, k_recent, v_recent
        )
        ep = ExpandedParams(
            k_rotation, v_rotation, k_mean, k_clip, v_clip, True,
            k_rope_mean=k_rope_mean, k_rope_inv_freq=k_rope_inv_freq, k_rope_ab=k_rope_ab,
            k_rope_theta=k_rope_theta, k_rope_pairs=k_rope_pairs,
        )  # fmt: skip
        return decode_attention(q, cache, ep, block_table, seq_lens, window_slots, softmax_scale)

    @_decode.register_fake
    def _(q, *args, **kwargs):
        return torch.empty_like(q)


def decode_attention_op(
    q: torch.Tensor,
    cache: PagedKVCache,
    params: ExpandedParams,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`oscar_kernels.decode_attention` through ``torch.ops.oscar.decode_attention``."""
    register_ops()
    c = cache
    scale = softmax_scale if softmax_scale is not None else cache.layout.head_dim**-0.5
    return torch.ops.oscar.decode_attention(
        q,
        c.k_codes,
        c.v_codes,
        c.k_scale,
        c.k_zero,
        c.v_scale,
        c.v_zero,
        c.k_sink,
        c.v_sink,
        c.k_recent,
        c.v_recent,
        params.k_rotation,
        params.v_rotation,
        params.k_mean,
        params.k_clip,
        params.v_clip,
        block_table,
        seq_lens,
        window_slots,
        cache.layout.group,
        float(scale),
        params.k_rope_mean,
        params.k_rope_inv_freq,
        params.k_rope_ab,
        params.k_rope_theta,
        params.k_rope_pairs,
    )
