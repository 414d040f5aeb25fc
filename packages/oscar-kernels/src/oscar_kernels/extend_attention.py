"""Public prefill / extend attention op: a chunk over INT2 history + BF16 windows + itself."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from oscar_math import check
from oscar_math.rope_center import rope_score_coef

from ._backend import Backend, dot_dtype, interpreting, unpack_mode, use_triton
from ._validate import check_extend_bounds, check_index_tensor, check_queries
from .decode_attention import _num_sms, merge_partials, rope_slots
from .extend_dense import DenseAttention, extend_attention_dense
from .launch import launch
from .layout import PagedKVCache
from .params import ExpandedParams, LayerQuantParams, as_expanded
from .reference.attention import extend_attention_ref
from .rotate import rotate_chunk, rotate_queries, unrotate_output


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch/output allocation (a hook: the GPU check script poisons it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


#: the last compiled kernel (diagnostics for benchmarks)
LAST_COMPILED: dict = {}

__all__ = ["extend_attention", "run_extend", "extend_block_m", "choose_extend_splits"]


#: chunks shorter than this many tokens read their prefix as INT2 in the Triton kernel (one pass
#: over the packed rows); longer ones through the dense kernel, whose cost is materialising the
#: prefix in bf16 (~7x the INT2 bytes, written and read again), amortised over the chunk's queries
DENSE_MIN_QUERY = 128
#: far-set rows materialised by one dense call (K and V bf16): rows beyond go to further calls, so
#: a batch of long prefixes never asks for tens of GiB (1 GiB at 8 KV heads x 128)
DENSE_MAX_FAR_ROWS = 1 << 18


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    params: LayerQuantParams | ExpandedParams,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor,
    window_slots: torch.Tensor,
    max_query_len: int,
    softmax_scale: float | None = None,
    backend: Backend | str = "auto",
    block_m: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    check_bounds: bool | None = None,
    dense: DenseAttention | None = None,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
    dense_min_query: int = DENSE_MIN_QUERY,
    num_splits: int | str = 1,
) -> torch.Tensor:
    """Causal attention of new chunks (varlen batch) over their cached prefixes.

    Sequence ``b`` has ``prefix_lens[b]`` tokens already in the cache and
    ``cu_seqlens_q[b+1] - cu_seqlens_q[b]`` new tokens in ``q/k/v``. The windows apply
    per query token, exactly as in decode: query ``t`` reads key ``j <= t`` as its INT2
    row iff ``sink <= j <= t - recent``, and in BF16 otherwise — from the sink rows
    (``j < sink``), the ring (a prefix key) or this call's rotated ``k``/``v`` (a key of
    the chunk). A token's output therefore does not depend on how its prompt was cut
    into chunks or batched, and equals what token-by-token decode computes.

    Order of writes: the chunk's INT2 rows and sink rows must be written before this
    call (``paged_write(..., parts="pages")``: a chunk longer than ``recent`` reads its
    own older keys as INT2), its ring rows after it (``parts="ring"``: they overwrite
    the ring rows of positions ``t - recent`` that the chunk's first queries read).

    Args:
        q: ``[T, H_q, d]``; k, v: ``[T, H_kv, d]`` un-rotated (after RoPE).
        cache, params: as :func:`oscar_kernels.decode_attention`.
        cu_seqlens_q: ``[B+1]`` int32 chunk offsets in ``q``.
        prefix_lens: ``[B]`` int32 cached tokens before each chunk.
        block_table: ``[B, max_pages]`` int32; window_slots: ``[B]`` int32.
        max_query_len: host int, the longest chunk (sizes the grid).
        backend, block_n, num_warps, num_stages: as :func:`oscar_kernels.decode_attention`.
        block_m: rows of a program, each a (chunk token, query head) pair of one KV head, so a
            program holds ``block_m // GQA`` tokens of all GQA heads (at least ``GQA`` rows;
            ``None``: :func:`extend_block_m`, 16 to 64 by the longest chunk).
        check_bounds: check that chunk offsets, prefix pages and window rows are in range
            (one host synchronisation; ``None`` = :func:`oscar_kernels.set_bounds_checks`'s
            setting, off while a CUDA graph is captured). Raises :class:`OscarError`.
        dense: a dense flash-attention kernel (:data:`oscar_kernels.extend_dense.DenseAttention`,
            e.g. the engine's FlashAttention): chunks of at least ``dense_min_query`` tokens then
            run through it (:func:`oscar_kernels.extend_dense.extend_attention_dense`), shorter
            ones (decodes of a mixed batch, a prefix-cache hit's short tail) through the Triton
            kernel (:func:`dense_runs`). GPU only; ignored elsewhere.
        host_lens: ``(query_lens, seq_len_bounds)`` on the host for ``dense``: the chunk lengths
            and upper bounds of ``prefix + chunk`` (else read back: one host synchronisation).
        dense_min_query: the shortest chunk that goes through ``dense``.
        num_splits: splits of each query block's INT2 keys over extra programs, merged after
            (:func:`merge_partials`); ``"auto"``: :func:`choose_extend_splits` (more than one only
            where the grid would leave SMs idle: a short chunk over a long prefix, e.g. a prefix
            hit's tail). GPU and interpreter only; the torch path ignores it.
    Returns:
        ``[T, H_q, d]`` in ``q.dtype``.
    """
    lo = cache.layout
    check_queries("q", q, cache, 3)
    t = q.shape[0]
    exp = (t, lo.num_kv_heads, lo.head_dim)
    check(tuple(k.shape) == exp, "shape of k", exp, tuple(k.shape))
    check(tuple(v.shape) == exp, "shape of v", exp, tuple(v.shape))
    bsz = prefix_lens.shape[0] if prefix_lens.dim() == 1 else -1
    check_index_tensor("prefix_lens", prefix_lens, (bsz,), cache.device)
    check_index_tensor("cu_seqlens_q", cu_seqlens_q, (bsz + 1,), cache.device)
    check_index_tensor("window_slots", window_slots, (bsz,), cache.device)
    check(block_table.dim() == 2, "rank of block_table", 2, block_table.dim())
    check_index_tensor("block_table", block_table, (bsz, block_table.shape[1]), cache.device)
    check(max_query_len >= 0, "max_query_len", ">= 0", max_query_len)
    check(
        num_splits == "auto" or (type(num_splits) is int and num_splits >= 1),
        "num_splits",
        ">= 1 or 'auto'",
        num_splits,
    )
    check_extend_bounds(
        cache, t, max_query_len, cu_seqlens_q, prefix_lens, block_table, window_slots, check_bounds
    )
    ep = as_expanded(params, lo.num_kv_heads, lo.head_dim, cache.device)
    return run_extend(
        q, k, v, cache, ep, cu_seqlens_q, prefix_lens, block_table, window_slots, max_query_len,
        softmax_scale, backend, block_m, block_n, num_warps, num_stages, dense, host_lens,
        dense_min_query, num_splits,
    )  # fmt: skip


def run_extend(
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
    backend: Backend | str = "auto",
    block_m: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    dense: DenseAttention | None = None,
    host_lens: tuple[Sequence[int], Sequence[int]] | None = None,
    dense_min_query: int = DENSE_MIN_QUERY,
    num_splits: int | str = 1,
) -> torch.Tensor:
    """:func:`extend_attention` without its checks (the caller checked the step's tensors once,
    e.g. an engine's step plan): the same arguments, ``params`` already expanded."""
    lo = cache.layout
    g = q.shape[1] // lo.num_kv_heads
    t = q.shape[0]
    bsz = prefix_lens.shape[0]
    if not use_triton(cache.device, backend):
        return extend_attention_ref(
            q,
            k,
            v,
            cache,
            ep,
            cu_seqlens_q,
            prefix_lens,
            block_table,
            window_slots,
            max_query_len,
            softmax_scale,
        )
    import triton

    from .kernels.attention import extend_kernel

    scale = 1.0 / math.sqrt(lo.head_dim) if softmax_scale is None else softmax_scale
    if dense is not None and t > 0 and max_query_len >= dense_min_query:
        return _extend_split(
            q, k, v, cache, ep, cu_seqlens_q, prefix_lens, block_table, window_slots, scale, dense,
            host_lens, dense_min_query, num_splits,
        )  # fmt: skip
    q_rot = rotate_queries(q, ep)
    k_rot, v_rot = rotate_chunk(k, v, ep)
    out = _empty(*q.shape, dtype=torch.float32, device=q.device)
    if t == 0 or max_query_len == 0:
        return out.to(q.dtype)
    opts = {} if interpreting() else {"num_warps": num_warps, "num_stages": num_stages}
    rows = extend_block_m(max_query_len, g) if block_m is None else max(block_m, _pow2_at_least(g))
    grid = (triton.cdiv(max_query_len, rows // g), bsz * lo.num_kv_heads)
    if ep.rope_pairs > 0:  # the pre-RoPE mean's score coefficients per query token (torch, on device)
        npad = rope_slots(ep.rope_pairs)
        rc = rope_score_coef(q, ep.k_rope_ab, ep.k_rope_pairs)  # [T, H_q, 2, R]
        rc = torch.nn.functional.pad(rc, (0, npad - ep.rope_pairs)).contiguous()
        opts.update(rc_ptr=rc, rth_ptr=ep.k_rope_theta.contiguous(), ROPE_R=ep.rope_pairs, ROPE_P=npad)
    splits = num_splits if num_splits != "auto" else 1
    if num_splits == "auto":  # host work only where asked for: this runs once per layer and step
        max_len = (
            max(host_lens[1]) if host_lens and len(host_lens[1]) else block_table.shape[1] * lo.page_size
        )
        splits = choose_extend_splits(grid[0] * grid[1], max_len, block_n, q.device)
    if splits > 1:
        hq, d = q.shape[1], lo.head_dim
        po = _empty(t, hq, splits, d, dtype=torch.float32, device=q.device)
        plse = _empty(t, hq, splits, dtype=torch.float32, device=q.device)
        opts.update(po_ptr=po, plse_ptr=plse, splits=splits, SPLIT=True)
        grid = (*grid, splits)
    LAST_COMPILED["extend"] = launch(
        extend_kernel,
        grid,
        q_rot,
        q_rot.stride(0),
        q_rot.stride(1),
        k_rot,
        v_rot,
        k_rot.stride(0),
        k_rot.stride(1),
        *cache.kernel_operands(),
        block_table,
        block_table.stride(0),
        cu_seqlens_q,
        prefix_lens,
        window_slots,
        out,
        out.stride(0),
        out.stride(1),
        scale * math.log2(math.e),
        lo.page_size,
        H_Q=q.shape[1],
        GQA=g,
        HEAD_DIM=lo.head_dim,
        GROUP=lo.group,
        SINK=lo.sink_tokens,
        RECENT=lo.recent_tokens,
        RING=max(1, lo.recent_tokens),
        BLOCK_M=rows,
        BLOCK_N=block_n,
        DOT=dot_dtype(),
        UNPACK=unpack_mode(),
        PAGE_TILES=lo.page_size % block_n == 0 and lo.sink_tokens % block_n == 0,
        **opts,
    )
    if splits > 1:
        # one merge chunk for every split count (<= 64): one compile, where the count's own power
        # of two would compile per count
        unrotate = None if ep.rotated_output else ep.v_rotation
        return merge_partials(po, plse, g, unrotate, q.dtype, chunk=64)
    return unrotate_output(out, ep, q.dtype)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def extend_block_m(max_query_len: int, gqa: int) -> int:
    """Rows of an extend program for chunks of up to ``max_query_len`` tokens and ``gqa`` query heads
    per KV head: the power of two that holds one chunk's rows, within ``[16, 64]`` (16 is the
    smallest ``tl.dot`` M; 64 keeps the accumulators in registers), and never fewer than ``gqa``.

    A prefix hit's 16-token tail at GQA 4 is 64 rows of one program per KV head (with 64 rows of
    one query head per program it was 16 used rows of 64, each KV tile dequantised per query head);
    a decode of a mixed batch is 16 rows with ``gqa`` of them used."""
    return max(16, min(64, _pow2_at_least(max(1, max_query_len) * gqa)), _pow2_at_least(gqa))


def choose_extend_splits(programs: int, max_len: int, block_n: int, device: torch.device) -> int:
    """Splits of the INT2 keys for an extend grid of ``programs`` programs over sequences of up to
    ``max_len`` tokens: 1 where the grid already covers the SMs or the context is short, else
    about two programs per SM, at most 64, never a split shorter than four tiles, rounded down to
    a power of two (the kernel takes the count at run time: one compile serves them all).

    Without splits a prefix hit's 16-token tail over 100k cached tokens at the Qwen3-8B shape is 8
    programs (one per KV head) that each read the whole prefix: 6.4 ms a layer on the H200, 0.30 ms
    with 32 splits (torch's flash SDPA on BF16: 0.33 ms). Depends on host-known sizes only (no
    device read)."""
    sms = _num_sms(device)
    if programs >= sms or max_len < 8 * block_n:
        return 1
    want = min(-(-2 * sms // max(programs, 1)), max_len // (4 * block_n), 64)
    return 1 << max(0, int(want).bit_length() - 1)  # a power of two: few merge shapes


def dense_runs(
    query_lens: Sequence[int],
    seq_len_bounds: Sequence[int],
    recent: int,
    min_query: int = DENSE_MIN_QUERY,
    max_far_rows: int = DENSE_MAX_FAR_ROWS,
) -> list[tuple[int, int, bool]]:
    """Consecutive row ranges ``(first, end, dense)`` of a batch: a row goes dense when its chunk
    has at least ``min_query`` tokens; a dense range holds at most ``max_far_rows`` far-set rows
    (``seq_len_bound - recent`` per row; a longer row alone); rows without tokens join the range
    before them."""
    runs: list[list] = []  # [first, end, dense, far rows]
    for i, (m, n) in enumerate(zip(query_lens, seq_len_bounds, strict=True)):
        dense = m >= min_query if m else bool(runs and runs[-1][2])
        far = max(0, int(n) - recent) if dense else 0
        last = runs[-1] if runs else None
        if last is not None and last[2] == dense and (not dense or last[3] + far <= max_far_rows):
            last[1], last[3] = i + 1, last[3] + far
        else:
            runs.append([i, i + 1, dense, far])
    return [(a, b, d) for a, b, d, _ in runs]


def _extend_split(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedKVCache,
    ep: ExpandedParams,
    cu: torch.Tensor,
    prefix: torch.Tensor,
    block_table: torch.Tensor,
    window_slots: torch.Tensor,
    scale: float,
    dense: DenseAttention,
    host_lens: tuple[Sequence[int], Sequence[int]] | None,
    min_query: int,
    num_splits: int | str = 1,
) -> torch.Tensor:
    """Short chunks (decodes among them) through the Triton kernel, long ones through ``dense``
    (:func:`dense_runs`), one call per consecutive range of rows."""
    if host_lens is None:
        qlens = (cu[1:] - cu[:-1]).tolist()
        bounds = [p + m for p, m in zip(prefix.tolist(), qlens, strict=True)]
    else:
        qlens, bounds = list(host_lens[0]), list(host_lens[1])
    out = _empty(*q.shape, dtype=q.dtype, device=q.device)
    starts = [0]
    for m in qlens:
        starts.append(starts[-1] + m)
    runs = dense_runs(qlens, bounds, cache.layout.recent_tokens, min_query, DENSE_MAX_FAR_ROWS)
    for a, b, use_dense in runs:
        t0, t1 = starts[a], starts[b]
        if t1 == t0:
            continue
        rows = (q[t0:t1], k[t0:t1], v[t0:t1], cache, ep, cu[a : b + 1] - t0, prefix[a:b], block_table[a:b])
        if use_dense:
            out[t0:t1] = extend_attention_dense(
                *rows, window_slots[a:b], qlens[a:b], bounds[a:b], scale, dense
            )
        else:
            out[t0:t1] = run_extend(
                *rows, window_slots[a:b], max(qlens[a:b]), scale,
                host_lens=(qlens[a:b], bounds[a:b]), num_splits=num_splits,
            )  # fmt: skip
    return out
