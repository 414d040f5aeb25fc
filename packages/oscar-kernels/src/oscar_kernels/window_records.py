"""Window records: each token's BF16 ring row, and its window block's sink part, into engine pages.

An engine that shares KV blocks between requests (prefix caching) also needs the BF16 window
rows of a cached prefix: a request that hits ``N`` cached tokens reads positions ``[0, sink)``
and ``(N - recent, N)`` in BF16. They are kept per *window block* of ``block_size`` tokens as one
*record* — the ring rows of the block's tokens ``[2 (K, V), H_kv, block_size, d]``, then sink part
``block % sink_parts`` ``[2, H_kv, sink_part, d]`` — whose row ``r`` lives in row
``r % rows_per_page`` of page ``tables[r // rows_per_page, seq, block]``: a record spans the
pages of several page tables (an engine's KV-cache groups).

:func:`write_window_records` stores a step's rows (one Triton launch on the GPU: the torch form is
~50 small kernels per layer); :func:`write_window_records_ref` is its torch reference.
"""

from __future__ import annotations

import torch

from oscar_math import check

from ._backend import Backend, use_triton
from .launch import launch

__all__ = ["write_window_records", "write_window_records_ref"]

#: tokens per program of the Triton write: one [16, d] tile per (tokens, K/V, head) instead of a
#: program per token row (262k programs of 256 bytes for a 16k-token chunk at 8 KV heads)
_TOK = 16
#: tokens per sink-part chunk (a [_TC * sink_part, d] tile; ``_TOK`` a multiple of it)
_TC = 4


def _check(rows, tables, seq_index, positions, window_slots, ring_k, ring_v, ring_rows, sink_k, sink_v):  # noqa: ANN001
    check(rows.dim() == 3, "rank of rows [pages, rows_per_page, d]", 3, rows.dim())
    check(tables.dim() == 3, "rank of tables [G, B, W]", 3, tables.dim())
    for name, a, c in (("ring", ring_k, ring_v), ("sink", sink_k, sink_v)):
        shapes = (tuple(a.shape), tuple(c.shape))
        check(
            a.dim() == 4 and a.shape == c.shape,
            f"shape of {name}_k/{name}_v",
            f"[S, H, {name}, d] alike",
            shapes,
        )
    d = rows.shape[2]
    check(ring_k.shape[3] == d and sink_k.shape[3] == d, "head_dim of ring/sink", d,
          (ring_k.shape[3], sink_k.shape[3]))  # fmt: skip
    check(
        seq_index.shape == positions.shape,
        "shape of positions",
        tuple(seq_index.shape),
        tuple(positions.shape),
    )
    b = tables.shape[1]
    check(window_slots.shape[0] >= b and ring_rows.shape[0] >= b, "rows of window_slots/ring_rows", f">= {b}",
          (window_slots.shape[0], ring_rows.shape[0]))  # fmt: skip


def write_window_records_ref(
    rows: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    sink_part: int,
    sink_parts: int,
    slot_mapping: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    window_slots: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_rows: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    sink_in_ring: bool,
) -> None:
    """Torch reference of :func:`write_window_records` (same arguments)."""
    n = seq_index.shape[0]
    keep = (slot_mapping[:n] >= 0).nonzero().flatten()
    if keep.numel() == 0:
        return
    dev = rows.device
    h, ring, sink = ring_k.shape[1], ring_k.shape[2], sink_k.shape[2]
    sidx = seq_index[keep].long()
    pos = positions[keep].long()
    slots = window_slots.long()[sidx]
    src_rows = ring_rows.long()[sidx]
    tables = tables.long()
    heads = torch.arange(h, device=dev)
    wb, rpp = block_size, rows.shape[1]
    block = (pos // wb)[:, None]
    in_sink = (pos < sink)[:, None, None]
    for kv, src, sink_src in ((0, ring_k, sink_k), (1, ring_v, sink_v)):
        r = (kv * h + heads[None, :]) * wb + (pos % wb)[:, None]  # [n, H] record rows
        page = tables[r // rpp, sidx[:, None], block]
        vals = src[src_rows, :, pos % ring]  # [n, H, d]
        if sink_in_ring and sink:  # positions < sink live in the sink rows, not the ring
            vals = torch.where(in_sink, sink_src[slots, :, pos.clamp(max=sink - 1)], vals)
        rows[page, r % rpp] = vals.to(rows.dtype)
    if sink == 0 or sink_part == 0:
        return
    s = ((pos // wb) % sink_parts)[:, None] * sink_part + torch.arange(sink_part, device=dev)[None, :]
    s_ok = s < sink  # [n, part]
    for kv, src in ((0, sink_k), (1, sink_v)):
        r = 2 * h * wb + (kv * h + heads[None, :, None]) * sink_part + torch.arange(sink_part, device=dev)
        page = tables[r // rpp, sidx[:, None, None], block[:, :, None]]  # [n, H, part]
        vals = src[slots[:, None, None], heads[None, :, None], s.clamp(max=sink - 1)[:, None, :]]
        ok = s_ok[:, None, :].expand_as(page)
        rows[page[ok], (r % rpp).expand_as(page)[ok]] = vals[ok].to(rows.dtype)


def write_window_records(
    rows: torch.Tensor,
    tables: torch.Tensor,
    block_size: int,
    sink_part: int,
    sink_parts: int,
    slot_mapping: torch.Tensor,
    seq_index: torch.Tensor,
    positions: torch.Tensor,
    window_slots: torch.Tensor,
    ring_k: torch.Tensor,
    ring_v: torch.Tensor,
    ring_rows: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    sink_in_ring: bool,
    backend: Backend | str = "auto",
) -> None:
    """Store each written token's window rows in its window block's record (module docstring).

    Args:
        rows: ``[num_pages, rows_per_page, d]`` page rows (bf16 view of the engine's pages).
        tables: ``[G, B, W]`` page tables of the step's rows (integer; any strides).
        block_size, sink_part, sink_parts: the record geometry (tokens per window block, sink
            rows per record, records per sink copy).
        slot_mapping: ``[>= T]``; tokens with a negative slot (padding) write nothing.
        seq_index, positions: ``[T]`` each token's row in the batch and position.
        window_slots: ``[>= B]`` each row's window slot (where its sink rows are: ``sink_k/v``).
        ring_k, ring_v: ``[S, H_kv, ring, d]`` ring rows; token ``t`` of row ``b`` reads
            ``ring[ring_rows[b], :, positions[t] % ring]``.
        ring_rows: ``[>= B]`` the ring row of each batch row.
        sink_k, sink_v: ``[S, H_kv, sink, d]`` sink rows (``sink`` may be 0).
        sink_in_ring: tokens at positions ``< sink`` take their ring row from the sink rows
            (a cache whose write keeps those positions in the sink only).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``), ``triton``, ``torch``.

    No host synchronisation on the Triton path (a CUDA graph captures it).
    """
    args = (rows, tables, seq_index, positions, window_slots, ring_k, ring_v, ring_rows, sink_k, sink_v)
    _check(*args)
    n = seq_index.shape[0]
    if n == 0:
        return
    if not use_triton(rows.device, backend):
        write_window_records_ref(
            rows, tables, block_size, sink_part, sink_parts, slot_mapping, seq_index, positions,
            window_slots, ring_k, ring_v, ring_rows, sink_k, sink_v, sink_in_ring,
        )  # fmt: skip
        return
    import triton

    from .kernels.window_records import window_records_kernel

    if tables.stride(-1) != 1:  # the kernel steps along a table row by 1
        tables = tables.contiguous()
    h, ring, sink, d = ring_k.shape[1], ring_k.shape[2], sink_k.shape[2], rows.shape[2]
    for t in (rows, ring_k, ring_v, sink_k, sink_v):
        check(t.numel() == 0 or t.stride(-1) == 1, "last stride of rows/ring/sink", 1, t.stride(-1))
    part = sink_part if sink else 0
    launch(window_records_kernel, (triton.cdiv(n, _TOK), 2 * h),
        rows, rows.stride(0), rows.stride(1),
        tables, tables.stride(0), tables.stride(1),
        slot_mapping, seq_index, positions, window_slots, ring_rows,
        ring_k, ring_v, ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        sink_k, sink_v, sink_k.stride(0), sink_k.stride(1), sink_k.stride(2),
        n, RPP=rows.shape[1], RING=ring, WB=block_size, PARTS=max(sink_parts, 1),
        H=h, SINK=sink, PART=part, PART_P2=triton.next_power_of_2(max(part, 1)),
        D=d, D_P2=triton.next_power_of_2(d), SINK_IN_RING=bool(sink_in_ring and sink), TOK=_TOK,
        TC=_TC,
    )  # fmt: skip
