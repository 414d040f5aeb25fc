"""Torch reference of the fused write (rotate, clip, quantise, pack, store)."""

from __future__ import annotations

import torch

from oscar_math import quantize_int2
from oscar_math.feedback import quantize_int2_feedback
from oscar_math.rope_center import rope_position_mean

from ..layout import PagedKVCache
from ..params import ExpandedParams

#: what a write stores, by ``parts`` (:func:`oscar_kernels.paged_write`): (INT2 rows, sink rows, ring rows)
PART_ROWS = {
    "all": (True, True, True),
    "pages": (True, True, False),  # a chunk's write before its attention
    "ring": (False, False, True),  # ... and after it
    "window": (False, True, True),  # a decode step's BF16 rows, before its attention
    "codes": (True, False, False),  # ... and its INT2 rows, beside it (serving.run_layer)
}

__all__ = ["paged_write_ref"]


def paged_write_ref(
    cache: PagedKVCache,
    ep: ExpandedParams,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    seq_index: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
    parts: str = "all",
) -> None:
    """Write ``N`` tokens into ``cache`` (in place). Arguments as :func:`oscar_kernels.paged_write`.

    With a pre-RoPE key mean (``ep.k_rope_mean``, format version 3) the INT2 key row of the
    token at position ``p`` is ``Q((k − k_mean − RoPE_p(m)) @ R_K)``
    (:func:`oscar_math.rope_center.rope_position_mean`, float64 angles); BF16 sink/ring rows
    stay ``(k − k_mean) @ R_K``.
    """
    lo = cache.layout
    valid = slot_mapping >= 0
    slot = slot_mapping[valid].long()
    k = key[valid].float()  # [n, H, d]
    v = value[valid].float()
    pos = positions[valid].long()
    km = k - ep.k_mean
    kr = torch.einsum("nhd,hde->nhe", km, ep.k_rotation)
    kq = kr  # what the INT2 key rows quantise
    if ep.k_rope_mean is not None:
        rope = rope_position_mean(ep.k_rope_mean, pos, ep.k_rope_inv_freq)  # [n, H, d] float32
        kq = torch.einsum("nhd,hde->nhe", km - rope, ep.k_rotation)
    vr = torch.einsum("nhd,hde->nhe", v, ep.v_rotation)
    page, off = slot // lo.page_size, slot % lo.page_size
    pages, sink, ring = PART_ROWS[parts]
    for x, a, fb, codes, scale, zero in (
        (kq, ep.k_clip, ep.k_feedback, cache.k_codes, cache.k_scale, cache.k_zero),
        (vr, ep.v_clip, ep.v_feedback, cache.v_codes, cache.v_scale, cache.v_zero),
    ):
        if not pages:
            break
        if fb is None:
            q = quantize_int2(x, lo.group, clip_ratio=a[:, None])
        else:  # error-feedback codes (oscar_math.feedback), [H, d, d] per KV head
            q = quantize_int2_feedback(x, lo.group, fb, clip_ratio=a[:, None])
        codes[page, :, off] = q.codes
        scale[page, :, off] = q.scale
        zero[page, :, off] = q.zero
    sidx = seq_index[valid].long()
    length = seq_lens.long()[sidx]
    ws = window_slots.long()[sidx]
    if sink and lo.sink_tokens > 0:
        m = pos < lo.sink_tokens
        cache.k_sink[ws[m], :, pos[m]] = kr[m].to(torch.bfloat16)
        cache.v_sink[ws[m], :, pos[m]] = vr[m].to(torch.bfloat16)
    if ring and lo.recent_tokens > 0:
        m = (pos >= lo.sink_tokens) & (pos >= length - lo.recent_tokens)
        row = pos[m] % lo.recent_tokens
        cache.k_recent[ws[m], :, row] = kr[m].to(torch.bfloat16)
        cache.v_recent[ws[m], :, row] = vr[m].to(torch.bfloat16)
