"""Torch references of decode and extend attention over the paged cache.

With a pre-RoPE key mean (``ep.rope_pairs > 0``, :mod:`oscar_math.rope_center`) the
dequantised INT2 rows get ``RoPE_p(m) @ R_K`` added back (``p`` the row's position); BF16
window rows (sink, ring, an extend chunk's own keys) are stored un-centred and are used as
they are. The kernels add the same thing as a per-key score term ``q · RoPE_p(m)``.
"""

from __future__ import annotations

import math

import torch

from oscar_math import bf16_ring_start, int2_mask, unpack_int2
from oscar_math.rope_center import rope_position_mean

from ..layout import PagedKVCache
from ..params import ExpandedParams
from ..rotate import rotate_chunk, rotate_queries, unrotate_output

__all__ = ["gather_rotated_kv", "decode_attention_ref", "extend_attention_ref"]


def _dequant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype) -> torch.Tensor:
    c = unpack_int2(codes).to(dtype)  # [n, H, d]
    n, h, d = c.shape
    g = c.reshape(n, h, d // group, group) * scale.to(dtype).unsqueeze(-1) + zero.to(dtype).unsqueeze(-1)
    return g.reshape(n, h, d)


def rope_mean_rows(ep: ExpandedParams | None, length: int, device: torch.device) -> torch.Tensor | None:
    """``RoPE_p(m) @ R_K`` ``[length, H_kv, d]`` float32 for positions ``[0, length)``: what the
    write subtracted from INT2 row ``p`` (``None`` without a pre-RoPE mean)."""
    if ep is None or ep.k_rope_mean is None:
        return None
    return rope_mean_at(ep, torch.arange(length, device=device))


def rope_mean_at(ep: ExpandedParams, positions: torch.Tensor) -> torch.Tensor:
    """``RoPE_p(m) @ R_K`` ``[N, H_kv, d]`` float32 at the INT2 rows' ``positions [N]``."""
    dev = positions.device
    rm = rope_position_mean(ep.k_rope_mean.to(dev), positions, ep.k_rope_inv_freq.to(dev))  # [N, H, d]
    return torch.einsum("nhd,hde->nhe", rm, ep.k_rotation.to(device=dev, dtype=torch.float32))


def _pages_rotated(
    cache: PagedKVCache,
    block_table_row: torch.Tensor,
    length: int,
    dtype: torch.dtype,
    ep: ExpandedParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised INT2 rows ``[length, H_kv, d]`` (rotated basis) of positions ``[0, length)``,
    with the pre-RoPE mean added back (``ep`` with ``k_rope_mean``)."""
    lo = cache.layout
    j = torch.arange(length, device=cache.device)
    page = block_table_row.long()[j // lo.page_size]
    off = j % lo.page_size
    k = _dequant(
        cache.k_codes[page, :, off], cache.k_scale[page, :, off], cache.k_zero[page, :, off], lo.group, dtype
    )
    v = _dequant(
        cache.v_codes[page, :, off], cache.v_scale[page, :, off], cache.v_zero[page, :, off], lo.group, dtype
    )
    rm = rope_mean_rows(ep, length, cache.device)
    if rm is not None:
        k = k + rm.to(dtype)
    return k, v


def gather_rotated_kv(
    cache: PagedKVCache,
    block_table_row: torch.Tensor,
    window_slot: int,
    length: int,
    window_end: int,
    dtype: torch.dtype = torch.float32,
    ep: ExpandedParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values ``[length, H_kv, d]`` of one sequence, in the rotated basis.

    Position ``j`` comes from the sink if ``j < sink``, from the ring if
    ``j >= max(sink, window_end - recent)``, else from the dequantised INT2 pages:
    what a query at position ``window_end - 1`` reads (decode: ``window_end`` is the
    cache length). ``ep``: the layer's parameters, for the pre-RoPE mean of the INT2 rows
    (required when it has one; the windows do not need it).
    """
    lo = cache.layout
    k, v = _pages_rotated(cache, block_table_row, length, dtype, ep)
    s = lo.sink_tokens
    ns = min(s, length)
    if ns > 0:
        k[:ns] = cache.k_sink[window_slot, :, :ns].transpose(0, 1).to(dtype)
        v[:ns] = cache.v_sink[window_slot, :, :ns].transpose(0, 1).to(dtype)
    if lo.recent_tokens > 0:
        r0 = bf16_ring_start(window_end - 1, s, lo.recent_tokens)  # the query at window_end - 1
        if r0 < length:
            rows = torch.arange(r0, length, device=cache.device) % lo.recent_tokens
            k[r0:] = cache.k_recent[window_slot, :, rows].transpose(0, 1).to(dtype)
            v[r0:] = cache.v_recent[window_slot, :, rows].transpose(0, 1).to(dtype)
    return k, v


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """``q [M, H_q, d]``, ``k/v [N, H_kv, d]`` → ``[M, H_q, d]`` (GQA by repeat)."""
    g = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(g, dim=1)
    vv = v.repeat_interleave(g, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q, kk) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hmn,nhd->mhd", p, vv)


def decode_attention_ref(
    q: torch.Tensor,
    cache: PagedKVCache,
    ep: ExpandedParams,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Reference of :func:`oscar_kernels.decode_attention` (same arguments)."""
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qr = rotate_queries(q, ep).float()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            continue
        k, v = gather_rotated_kv(cache, block_table[b], int(window_slots[b]), n, n, ep=ep)
        out[b] = _attend(qr[b : b + 1], k, v, scale, None)[0]
    return unrotate_output(out, ep, q.dtype)


def extend_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    ep: ExpandedParams,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor,
    window_slots: torch.Tensor,
    max_query_len: int,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """Reference of :func:`oscar_kernels.extend_attention` (same arguments).

    Query ``t`` reads key ``j <= t`` as the INT2 row iff ``sink <= j <= t - recent``, else
    in BF16: the sink row (``j < sink``), the ring row (a prefix key) or the chunk's own
    rotated key. Both copies of every key are built; a ``[m, n]`` mask picks one per pair.
    """
    lo = cache.layout
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    qr = rotate_queries(q, ep).float()
    kr, vr = rotate_chunk(k, v, ep)
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    s, r = lo.sink_tokens, lo.recent_tokens
    for b in range(prefix_lens.shape[0]):
        s0, s1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        m, p = s1 - s0, int(prefix_lens[b])
        if m == 0:
            continue
        n, ws = p + m, int(window_slots[b])
        kq, vq = _pages_rotated(cache, block_table[b], n, torch.float32, ep)  # the chunk's rows included
        # BF16 copies: INT2 rows stay only where never read as BF16 (the mask ``quant`` below
        # never picks them there, so their RoPE mean term does not matter)
        kb, vb = kq.clone(), vq.clone()
        ns = min(s, n)
        if ns > 0:
            kb[:ns] = cache.k_sink[ws, :, :ns].transpose(0, 1).float()
            vb[:ns] = cache.v_sink[ws, :, :ns].transpose(0, 1).float()
        if r > 0:
            r0 = bf16_ring_start(p, s, r)  # the oldest prefix key the first query reads in BF16
            if r0 < p:
                rows = torch.arange(r0, p, device=q.device) % r
                kb[r0:p] = cache.k_recent[ws, :, rows].transpose(0, 1).float()
                vb[r0:p] = cache.v_recent[ws, :, rows].transpose(0, 1).float()
            c0 = max(s, p)
            kb[c0:n] = kr[s0 + c0 - p : s1].float()
            vb[c0:n] = vr[s0 + c0 - p : s1].float()
        qpos = p + torch.arange(m, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        causal = j <= qpos  # [m, n]
        quant = int2_mask(qpos[:, 0], j[0], s, r)
        out[s0:s1] = _attend_mixed(qr[s0:s1], kb, vb, kq, vq, scale, causal, quant)
    return unrotate_output(out, ep, q.dtype)


def _attend_mixed(q, kb, vb, kq, vq, scale, causal, quant):
    """``q [m, H_q, d]`` over two copies ``[n, H_kv, d]`` of the keys/values: the INT2 copy
    where ``quant [m, n]``, the BF16 copy elsewhere, causally."""
    g = q.shape[1] // kb.shape[1]
    sb = torch.einsum("mhd,nhd->hmn", q, kb.repeat_interleave(g, dim=1)) * scale
    sq = torch.einsum("mhd,nhd->hmn", q, kq.repeat_interleave(g, dim=1)) * scale
    sc = torch.where(quant[None], sq, sb).masked_fill(~causal[None], float("-inf"))
    pr = torch.softmax(sc, dim=-1)
    pq = pr * quant[None]
    return torch.einsum("hmn,nhd->mhd", pr - pq, vb.repeat_interleave(g, dim=1)) + torch.einsum(
        "hmn,nhd->mhd", pq, vq.repeat_interleave(g, dim=1)
    )
