"""``torch.library`` registration of the three ops: ``torch.ops.oscar.decode_attention``,
``torch.ops.oscar.extend_attention`` and ``torch.ops.oscar.paged_write``.

A custom op with a fake (meta) implementation lets ``torch.compile`` trace through the
call and keeps it one opaque node in a captured graph. Tensors only: the cache is passed as
its ten tensors and the layout as integers; the parameters as tensors (optional ones —
error-feedback matrices, the pre-RoPE key mean's ``ExpandedParams.k_rope_*`` — as ``None``
when off). ``paged_write`` declares the cache tensors it writes in place. Registered on first
call of :func:`register_ops` (no import side effects).
"""

from __future__ import annotations

import functools

import torch

from .layout import CacheLayout, PagedKVCache
from .params import ExpandedParams

__all__ = ["register_ops", "decode_attention_op", "extend_attention_op", "paged_write_op"]

#: the order of a cache's tensors in the ops' ``cache`` list
CACHE_FIELDS = (
    "k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero",
    "k_sink", "v_sink", "k_recent", "v_recent",
)  # fmt: skip
#: the order of an :class:`ExpandedParams`' tensors in the ops' ``params`` list (``None``: absent)
PARAM_FIELDS = (
    "k_rotation", "v_rotation", "k_mean", "k_clip", "v_clip", "k_feedback", "v_feedback",
    "k_rope_mean", "k_rope_inv_freq", "k_rope_ab", "k_rope_theta", "k_rope_pairs",
)  # fmt: skip


def _cache_list(cache: PagedKVCache) -> list[torch.Tensor]:
    return [getattr(cache, f) for f in CACHE_FIELDS]


def _params_list(params: ExpandedParams) -> list[torch.Tensor | None]:
    return [getattr(params, f) for f in PARAM_FIELDS]


def _cache_from(tensors: list[torch.Tensor], group_size: int) -> PagedKVCache:
    k_codes, k_sink, k_recent = tensors[0], tensors[6], tensors[8]
    h, ps, d = k_codes.shape[1], k_codes.shape[2], k_sink.shape[-1]
    lo = CacheLayout(h, d, ps, group_size, k_sink.shape[2], k_recent.shape[2])
    return PagedKVCache(lo, *tensors)


def _params_from(
    tensors: list[torch.Tensor | None], has_mean: bool, rotated_output: bool = False
) -> ExpandedParams:
    named = dict(zip(PARAM_FIELDS, tensors, strict=True))
    return ExpandedParams(
        named.pop("k_rotation"), named.pop("v_rotation"), named.pop("k_mean"), named.pop("k_clip"),
        named.pop("v_clip"), has_mean, **named, rotated_output=rotated_output,
    )  # fmt: skip


@functools.lru_cache(maxsize=1)
def register_ops() -> None:
    """Register ``oscar::decode_attention``, ``oscar::extend_attention``, ``oscar::paged_write``
    and their fake twins (idempotent)."""

    @torch.library.custom_op("oscar::decode_attention", mutates_args=())
    def _decode(
        q: torch.Tensor,
        cache: list[torch.Tensor],
        params: list[torch.Tensor | None],
        has_mean: bool,
        rotated_output: bool,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        window_slots: torch.Tensor,
        group_size: int,
        softmax_scale: float,
    ) -> torch.Tensor:
        from .decode_attention import decode_attention

        return decode_attention(
            q, _cache_from(cache, group_size), _params_from(params, has_mean, rotated_output),
            block_table, seq_lens, window_slots, softmax_scale,
        )  # fmt: skip

    @_decode.register_fake
    def _(q, *args, **kwargs):
        return torch.empty_like(q)

    @torch.library.custom_op("oscar::extend_attention", mutates_args=())
    def _extend(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: list[torch.Tensor],
        params: list[torch.Tensor | None],
        has_mean: bool,
        rotated_output: bool,
        cu_seqlens_q: torch.Tensor,
        prefix_lens: torch.Tensor,
        block_table: torch.Tensor,
        window_slots: torch.Tensor,
        max_query_len: int,
        group_size: int,
        softmax_scale: float,
    ) -> torch.Tensor:
        from .extend_attention import extend_attention

        return extend_attention(
            q, k, v, _cache_from(cache, group_size), _params_from(params, has_mean, rotated_output),
            cu_seqlens_q, prefix_lens, block_table, window_slots, max_query_len, softmax_scale,
        )  # fmt: skip

    @_extend.register_fake
    def _(q, *args, **kwargs):
        return torch.empty_like(q)

    @torch.library.custom_op("oscar::paged_write", mutates_args=("cache",))
    def _write(
        key: torch.Tensor,
        value: torch.Tensor,
        cache: list[torch.Tensor],
        params: list[torch.Tensor | None],
        has_mean: bool,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        seq_index: torch.Tensor,
        seq_lens: torch.Tensor,
        window_slots: torch.Tensor,
        group_size: int,
        parts: str,
    ) -> None:
        from .paged_write import paged_write

        paged_write(
            _cache_from(cache, group_size), _params_from(params, has_mean), key, value, slot_mapping,
            positions, seq_index, seq_lens, window_slots, parts=parts,
        )  # fmt: skip

    @_write.register_fake
    def _(*args, **kwargs):
        return None


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
    scale = softmax_scale if softmax_scale is not None else cache.layout.head_dim**-0.5
    return torch.ops.oscar.decode_attention(
        q, _cache_list(cache), _params_list(params), params.has_mean, params.rotated_output,
        block_table, seq_lens, window_slots, cache.layout.group, float(scale),
    )  # fmt: skip


def extend_attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    params: ExpandedParams,
    *batch: torch.Tensor | int,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """:func:`oscar_kernels.extend_attention` through ``torch.ops.oscar.extend_attention``;
    ``batch``: its ``cu_seqlens_q, prefix_lens, block_table, window_slots, max_query_len``. The
    Triton or reference path (the dense FlashAttention path takes a callable, which an op cannot)."""
    register_ops()
    cu_seqlens_q, prefix_lens, block_table, window_slots, max_query_len = batch
    scale = softmax_scale if softmax_scale is not None else cache.layout.head_dim**-0.5
    return torch.ops.oscar.extend_attention(
        q, k, v, _cache_list(cache), _params_list(params), params.has_mean, params.rotated_output,
        cu_seqlens_q, prefix_lens, block_table, window_slots, int(max_query_len), cache.layout.group,
        float(scale),
    )  # fmt: skip


def paged_write_op(
    cache: PagedKVCache,
    params: ExpandedParams,
    key: torch.Tensor,
    value: torch.Tensor,
    *tokens: torch.Tensor,
    parts: str = "all",
) -> None:
    """:func:`oscar_kernels.paged_write` through ``torch.ops.oscar.paged_write``, which declares
    ``cache`` written in place; ``tokens``: its ``slot_mapping, positions, seq_index, seq_lens,
    window_slots``."""
    register_ops()
    torch.ops.oscar.paged_write(
        key,
        value,
        _cache_list(cache),
        _params_list(params),
        params.has_mean,
        *tokens,
        cache.layout.group,
        parts,
    )
