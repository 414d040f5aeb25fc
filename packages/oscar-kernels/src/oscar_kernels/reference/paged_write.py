"""Torch reference of the fused write (rotate, clip, quantise, pack, store)."""

from __future__ import annotations

import torch

from oscar_math import quantize_int2
from oscar_math.feedback import quantize_int2_feedback

from ..layout import PagedKVCache
from ..params import ExpandedParams

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
    """Write ``N`` tokens into ``cache`` (in place). Arguments as :func:`oscar_kernels.paged_write`."""
    lo = cache.layout
    valid = slot_mapping >= 0
    slot = slot_mapping[valid].long()
    k = key[valid].float()  # [n, H, d]
    v = value[valid].float()
    kr = torch.einsum("nhd,hde->nhe", k - ep.k_mean, ep.k_rotation)
    vr = torch.einsum("nhd,hde->nhe", v, ep.v_rotation)
    page, off = slot // lo.page_size, slot % lo.page_size
    pages, ring = parts != "ring", parts != "pages"
    for x, a, fb, codes, scale, zero in (
        (kr, ep.k_clip, ep.k_feedback, cache.k_codes, cache.k_scale, cache.k_zero),
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
    pos = positions[valid].long()
    sidx = seq_index[valid].long()
    length = seq_lens.long()[sidx]
    ws = window_slots.long()[sidx]
    if pages and lo.sink_tokens > 0:
        m = pos < lo.sink_tokens
        cache.k_sink[ws[m], :, pos[m]] = kr[m].to(torch.bfloat16)
        cache.v_sink[ws[m], :, pos[m]] = vr[m].to(torch.bfloat16)
    if ring and lo.recent_tokens > 0:
        m = (pos >= lo.sink_tokens) & (pos >= length - lo.recent_tokens)
        row = pos[m] % lo.recent_tokens
        cache.k_recent[ws[m], :, row] = kr[m].to(torch.bfloat16)
        cache.v_recent[ws[m], :, row] = vr[m].to(torch.bfloat16)
