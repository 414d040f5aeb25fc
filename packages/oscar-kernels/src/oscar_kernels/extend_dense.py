"""Prefill / extend attention through a dense flash-attention kernel (the engine's own).

The window rule splits the keys query ``t`` reads into two disjoint sets, each a plain
causal attention with an offset, so a dense varlen kernel (FlashAttention, what the engine
already runs for BF16) computes both and a log-sum-exp merge joins them:

* *far*: positions ``j <= t - recent`` — the sink rows in BF16 (``j < sink``) and the
  dequantised INT2 rows (``sink <= j``) with the pre-RoPE mean added back. Per sequence the
  keys are positions ``[0, L)``, ``L = prefix + chunk - recent``; causal aligned to the bottom
  right gives query ``i`` of the chunk the keys ``j <= i + L - chunk = t - recent``.
* *near*: positions ``t - recent < j <= t`` in BF16 — the ring (or sink) rows of the prefix
  and the chunk's own rotated keys; causal with a left window of ``recent - 1``.

Every key is in exactly one set, so the result is :func:`oscar_kernels.extend_attention_ref`'s
up to the rounding of the dequantised rows to the kernel's input dtype (bf16) and of the two
partial outputs. The INT2 rows of the prefix are materialised per call (``L·H_kv·d`` bf16 for
keys and values; processed in row blocks to bound the float32 temporaries).

``DenseAttention`` is the kernel's signature: ``attn(q, k, v, cu_q, cu_k, max_q, max_k, scale,
window_left) -> (out [T, H_q, d] in q.dtype, lse [H_q, T] float32)``; causal aligned to the bottom
right; ``window_left = -1`` for no window; a row with no key gives ``out = 0`` and an infinite
``lse`` (FlashAttention returns ``+inf``). :func:`dense_attention_ref` is its torch reference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ._backend import interpreting, triton_available
from .launch import launch
from .layout import PagedKVCache
from .params import ExpandedParams
from .reference.attention import _dequant, rope_mean_at
from .rotate import merge_unrotate, rotate_chunk, rotate_queries

__all__ = ["DenseAttention", "dense_attention_ref", "extend_attention_dense"]

DenseAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]

#: rows dequantised at once (bounds the float32 temporaries: ~16 MiB per 1k rows at 8 x 128 x 2)
DEQUANT_ROWS = 32768


def dense_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float,
    window_left: int = -1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of a :data:`DenseAttention` kernel (FlashAttention's varlen semantics).

    ``q [T, H_q, d]``, ``k/v [N, H_kv, d]``; sequence ``b`` has queries ``cu_q[b]:cu_q[b+1]`` and
    keys ``cu_k[b]:cu_k[b+1]``; query ``i`` reads key ``j`` iff ``j <= i + n_k - n_q`` and, with
    ``window_left >= 0``, ``j >= i + n_k - n_q - window_left``. Returns ``(out, lse)``:
    ``[T, H_q, d]`` in ``q.dtype`` and ``[H_q, T]`` float32; a row without keys: 0 and ``+inf``.
    """
    t, hq, d = q.shape
    out = torch.zeros(t, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.full((hq, t), float("inf"), dtype=torch.float32, device=q.device)
    g = hq // k.shape[1]
    for b in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        m, n = q1 - q0, k1 - k0
        if m == 0 or n == 0:
            continue
        kk = k[k0:k1].float().repeat_interleave(g, dim=1)
        vv = v[k0:k1].float().repeat_interleave(g, dim=1)
        s = torch.einsum("mhd,nhd->hmn", q[q0:q1].float(), kk) * scale
        i = torch.arange(m, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        ok = j <= i + n - m
        if window_left >= 0:
            ok &= j >= i + n - m - window_left
        s = s.masked_fill(~ok[None], float("-inf"))
        has = ok.any(dim=1)  # [m]
        row_lse = torch.logsumexp(s, dim=-1)  # [H, m]; -inf where no key
        p = torch.exp(s - torch.where(has[None, :], row_lse, 0.0)[..., None])
        out[q0:q1] = torch.einsum("hmn,nhd->mhd", p, vv) * has[:, None, None]
        lse[:, q0:q1] = torch.where(has[None, :], row_lse, float("inf"))
    return out.to(q.dtype), lse


def _segments(lens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed segments of device ``lens [B]`` in ``total >= sum(lens)`` rows, without a host
    synchronisation: ``(cu [B+1] int32, seq [total] long, idx [total] long)``; rows past the
    segments get ``seq = B - 1`` and an index past its segment (read, never attended)."""
    b = lens.shape[0]
    cu = torch.zeros(b + 1, dtype=torch.long, device=lens.device)
    cu[1:] = lens.long().cumsum(0)
    row = torch.arange(total, device=lens.device)
    seq = torch.searchsorted(cu[1:], row, right=True).clamp_(max=max(b - 1, 0))
    return cu.to(torch.int32), seq, row - cu[seq]


def _far_rows(
    cache: PagedKVCache,
    ep: ExpandedParams,
    block_table: torch.Tensor,
    window_slots: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The far set's rows: the Triton kernel (``kernels/far_rows.py``) on a GPU (and under the
    interpreter) for bf16 rows at head dims >= 64 (its dots need 16-wide quarters), else
    :func:`_far_rows_torch`, its reference."""
    lo = cache.layout
    triton_ok = triton_available() and (cache.device.type == "cuda" or interpreting())
    if not (triton_ok and dtype == torch.bfloat16 and lo.head_dim >= 64 and pos.shape[0] > 0):
        return _far_rows_torch(cache, ep, block_table, window_slots, seq, pos, dtype)
    import triton

    from .kernels.far_rows import far_rows_kernel

    n, h, d = pos.shape[0], lo.num_kv_heads, lo.head_dim
    k_out = torch.empty(n, h, d, dtype=dtype, device=cache.device)
    v_out = torch.empty(n, h, d, dtype=dtype, device=cache.device)
    block = 64
    grid = (triton.cdiv(n, block), h)
    rope = ep.k_rope_mean is not None
    opts = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": 4}
    rot = ep.k_rotation  # the RoPE term's rotation: key rows only (values pass it unread)
    for codes, sc, zr, sink, dst, has_rope in (
        (cache.k_codes, cache.k_scale, cache.k_zero, cache.k_sink, k_out, rope),
        (cache.v_codes, cache.v_scale, cache.v_zero, cache.v_sink, v_out, False),
    ):
        launch(
            far_rows_kernel, grid,
            seq, pos, block_table, block_table.stride(0), window_slots,
            codes, codes.stride(0), codes.stride(1), codes.stride(2),
            sc, zr, sc.stride(0), sc.stride(1), sc.stride(2),
            sink, sink.stride(0), sink.stride(1), sink.stride(2),
            ep.k_rope_mean if has_rope else sc, ep.k_rope_mean.stride(0) if has_rope else 0,
            ep.k_rope_inv_freq if has_rope else sc, rot, rot.stride(0), rot.stride(1),
            dst, dst.stride(0), dst.stride(1),
            n, lo.page_size, max(block_table.shape[1] - 1, 0),
            HEAD_DIM=d, GROUP=lo.group, SINK=lo.sink_tokens, HAS_ROPE=has_rope, BLOCK=block, **opts,
        )  # fmt: skip
    return k_out, v_out


def _far_rows_torch(
    cache: PagedKVCache,
    ep: ExpandedParams,
    block_table: torch.Tensor,
    window_slots: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``(seq, pos)`` as the far set reads them, in the rotated basis: the sink row for
    ``pos < sink``, else the dequantised INT2 row plus ``RoPE_pos(m) @ R_K`` (as the reference).
    Rows past a sequence's end read some page of the table (their values are never attended)."""
    lo = cache.layout
    n, h, d, s = pos.shape[0], lo.num_kv_heads, lo.head_dim, lo.sink_tokens
    k_out = torch.empty(n, h, d, dtype=dtype, device=cache.device)
    v_out = torch.empty(n, h, d, dtype=dtype, device=cache.device)
    last_page = max(block_table.shape[1] - 1, 0)
    for a in range(0, n, DEQUANT_ROWS):
        s_, p_ = seq[a : a + DEQUANT_ROWS], pos[a : a + DEQUANT_ROWS]
        page = block_table[s_, (p_ // lo.page_size).clamp(max=last_page)].long()
        off = p_ % lo.page_size
        in_sink = (p_ < s)[:, None, None]
        ws, sp = window_slots[s_].long(), p_.clamp(max=max(s - 1, 0))
        for codes, sc, zr, sink, dst in (
            (cache.k_codes, cache.k_scale, cache.k_zero, cache.k_sink, k_out),
            (cache.v_codes, cache.v_scale, cache.v_zero, cache.v_sink, v_out),
        ):
            x = _dequant(codes[page, :, off], sc[page, :, off], zr[page, :, off], lo.group, torch.float32)
            r = x.shape[0]
            if dst is k_out and ep.k_rope_mean is not None:
                x = x + rope_mean_at(ep, p_)
            if s > 0:  # the sink rows in BF16 (their INT2 copies are never read)
                x = torch.where(in_sink, sink[ws, :, sp].float(), x)
            dst[a : a + r] = x.to(dtype)
    return k_out, v_out


def _near_rows(
    cache: PagedKVCache,
    k_rot: torch.Tensor,
    v_rot: torch.Tensor,
    window_slots: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    prefix: torch.Tensor,
    chunk_start: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 rows ``(seq, pos)``: the chunk's own rotated keys for ``pos >= prefix[seq]``, else the
    sink row (``pos < sink``) or the ring row of the window slot. The Triton kernel
    (``kernels/near_rows.py``) on a GPU and under the interpreter, else :func:`_near_rows_torch`,
    its reference (bitwise: copies only)."""
    lo = cache.layout
    triton_ok = triton_available() and (cache.device.type == "cuda" or interpreting())
    if not (triton_ok and pos.shape[0] > 0 and k_rot.shape[0] > 0 and lo.recent_tokens > 0):
        return _near_rows_torch(cache, k_rot, v_rot, window_slots, seq, pos, prefix, chunk_start)
    import triton

    from .kernels.near_rows import near_rows_kernel

    n, h, d = pos.shape[0], lo.num_kv_heads, lo.head_dim
    block = 64
    out = []
    for rot, recent, sink in ((k_rot, cache.k_recent, cache.k_sink), (v_rot, cache.v_recent, cache.v_sink)):
        rot = rot if rot.stride(-1) == 1 else rot.contiguous()
        dst = torch.empty(n, h, d, dtype=rot.dtype, device=rot.device)
        launch(
            near_rows_kernel, (triton.cdiv(n, block), h),
            seq, pos, prefix, chunk_start, window_slots,
            rot, rot.stride(0), rot.stride(1),
            recent, recent.stride(0), recent.stride(1), recent.stride(2),
            sink, sink.stride(0), sink.stride(1), sink.stride(2),
            dst, dst.stride(0), dst.stride(1),
            n, rot.shape[0], lo.recent_tokens,
            D=d, D_P2=triton.next_power_of_2(d), SINK=lo.sink_tokens, BLOCK=block,
        )  # fmt: skip
        out.append(dst)
    return out[0], out[1]


def _near_rows_torch(
    cache: PagedKVCache,
    k_rot: torch.Tensor,
    v_rot: torch.Tensor,
    window_slots: torch.Tensor,
    seq: torch.Tensor,
    pos: torch.Tensor,
    prefix: torch.Tensor,
    chunk_start: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch form of :func:`_near_rows` (same arguments and result)."""
    lo = cache.layout
    s = lo.sink_tokens
    pre = prefix[seq]
    mine = (pos >= pre)[:, None, None]
    tok = (chunk_start[seq] + (pos - pre)).clamp(min=0, max=max(k_rot.shape[0] - 1, 0))
    ws = window_slots[seq].long()
    ring = pos % max(lo.recent_tokens, 1)
    out = []
    for rot, recent, sink in ((k_rot, cache.k_recent, cache.k_sink), (v_rot, cache.v_recent, cache.v_sink)):
        old = recent[ws, :, ring]
        if s > 0:
            old = torch.where((pos < s)[:, None, None], sink[ws, :, pos.clamp(max=s - 1)], old)
        out.append(torch.where(mine, rot[tok], old.to(rot.dtype)))
    return out[0], out[1]


def extend_attention_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    ep: ExpandedParams,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor,
    window_slots: torch.Tensor,
    query_lens_host: Sequence[int],
    seq_lens_bound_host: Sequence[int],
    scale: float,
    attn: DenseAttention,
) -> torch.Tensor:
    """:func:`oscar_kernels.extend_attention` through ``attn`` (module docstring); same arguments,
    plus on the host the chunk lengths and upper bounds of ``prefix + chunk`` (they size the
    packed key sets; the exact lengths stay on the device: no host synchronisation). Writes as
    there: the chunk's INT2 and sink rows before, its ring rows after. Returns ``[T, H_q, d]``."""
    lo = cache.layout
    r = lo.recent_tokens
    q_rot = rotate_queries(q, ep)
    k_rot, v_rot = rotate_chunk(k, v, ep)
    mq = max(query_lens_host, default=0)
    pre = prefix_lens.long()
    qlen = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    bound_far = [max(0, n - r) for n in seq_lens_bound_host]
    cu_f, seq_f, pos_f = _segments((pre + qlen - r).clamp(min=0), sum(bound_far))
    kf, vf = _far_rows(cache, ep, block_table, window_slots, seq_f, pos_f.clamp(min=0), q_rot.dtype)
    o1, l1 = attn(q_rot, kf, vf, cu_seqlens_q, cu_f, mq, max(bound_far, default=0), scale, -1)
    if r == 0:  # no BF16 ring: every key but the sink is read as INT2, the query's own included
        return merge_unrotate(o1, l1, None, None, ep, q.dtype)
    first = (pre - r + 1).clamp(min=0)
    bound_near = [min(n, m + r - 1) for n, m in zip(seq_lens_bound_host, query_lens_host, strict=True)]
    cu_n, seq_n, idx_n = _segments(pre + qlen - first, sum(bound_near))
    kn, vn = _near_rows(
        cache, k_rot, v_rot, window_slots, seq_n, idx_n + first[seq_n], pre, cu_seqlens_q[:-1].long()
    )
    o2, l2 = attn(q_rot, kn, vn, cu_seqlens_q, cu_n, mq, max(bound_near, default=0), scale, r - 1)
    return merge_unrotate(o1, l1, o2, l2, ep, q.dtype)
