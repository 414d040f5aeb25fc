"""BF16 window rows kept in engine pages, so a prefix-cache hit restores exactly what a miss wrote.

Query ``t`` reads key ``j`` in BF16 iff ``j < sink`` or ``j > t - recent``. A request that hits
``N`` cached tokens computes queries ``t >= N`` only, so besides the shared INT2 pages it needs
the BF16 rows of positions ``[0, sink)`` and ``(N - recent, N)`` — rows that depend only on the
prefix's tokens. Kept in pages that the engine's prefix cache shares like KV blocks (vLLM: a
sliding-window KV-cache group, so blocks leave once no query can read them), a hit restores
exactly these rows into a window slot and then computes what a miss computes (docs/vllm.md,
"Prefix caching").

* :func:`plan_window_records` / :class:`WindowPlan`: the record geometry;
  :class:`WindowPages`: one layer's records inside its page buffer.
* :func:`write_window_pages` (after each layer's step) and :func:`restore_windows` (a hit).
* :class:`~oscar_kernels.serving.record_stamps.RecordStamps`: which records are still intact where
  records are transient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from oscar_math import bf16_ring_start
from oscar_math.errors import OscarError

from ..layout import CacheLayout, PagedKVCache, allocate_cache
from ..window_records import write_window_records
from .plan import StepPlan, to_device
from .run import write_step

__all__ = [
    "WindowPlan",
    "window_sink_parts",
    "plan_window_records",
    "WindowPages",
    "hit_window_positions",
    "gather_columns",
    "scratch_ring",
    "write_window_pages",
    "restore_windows",
    "restore_window_rows",
]


@dataclass(frozen=True)
class WindowPlan:
    """Geometry of one layer's window records (chosen by :func:`plan_window_records`).

    ``block_size``: tokens per window block (a divisor of the INT2 block size: vLLM allows
    other block sizes in other KV-cache groups as long as the page bytes are equal).
    ``sink_parts``: the sink rows are cut into this many parts of ``sink_part`` positions;
    the record of window block ``j`` carries part ``j % sink_parts``. Any ``sink_parts``
    consecutive blocks carry the whole sink, and vLLM's sliding-window manager (window =
    ``recent``) always keeps that many blocks before a hit or a running request's position.
    ``groups``: pages (window KV-cache groups) per record.
    """

    block_size: int
    sink_parts: int
    sink_part: int
    groups: int

    def record_rows(self, num_kv_heads: int) -> int:
        """BF16 rows (of ``d``) in one block's record: ring rows + one sink part, K and V."""
        return 2 * num_kv_heads * (self.block_size + self.sink_part)


def window_sink_parts(block_size: int, sink: int, recent: int) -> tuple[int, int]:
    """``(parts, positions per part)``: as many parts as window blocks always held
    (``ceil((recent - 1) / block)``, the blocks of positions ``(p - recent, p)``)."""
    parts = max(1, -(-(max(recent, 2) - 1) // block_size))
    return parts, -(-sink // parts) if sink else 0


def plan_window_records(
    num_kv_heads: int,
    block_size: int,
    sink: int,
    recent: int,
    rows_per_page: int,
    in_flight_tokens: int,
    min_block: int = 16,
) -> WindowPlan:
    """The window-record geometry with the fewest pages held per running request.

    vLLM's sliding-window manager holds ``ceil((recent - 1 + in_flight) / wb) + 1`` blocks per
    group and request (its admission cap, what its concurrency count uses); a record of a
    ``wb``-token block needs ``ceil(2·H·(wb + sink_part) / rows_per_page)`` groups. Candidates:
    the divisors of ``block_size`` that are multiples of ``min_block`` (else ``block_size``).
    """
    cands = [w for w in range(min_block, block_size + 1, min_block) if block_size % w == 0] or [block_size]
    best: tuple[int, int, WindowPlan] | None = None
    for wb in cands:
        parts, part = window_sink_parts(wb, sink, recent)
        if part > wb:  # a record's sink part must be complete once its block is full
            continue
        groups = -(-2 * num_kv_heads * (wb + part) // rows_per_page)
        held = -(-(max(recent, 2) - 1 + in_flight_tokens) // wb) + 1
        cost = groups * held
        plan = WindowPlan(wb, parts, part, groups)
        if best is None or (cost, -wb) < (best[0], -best[1]):
            best = (cost, wb, plan)
    if best is None:
        raise OscarError(
            f"OSCAR: no window-record geometry for block size {block_size}, sink {sink}, recent {recent}"
        )
    return best[2]


@dataclass
class WindowPages:
    """One layer's BF16 window rows inside engine pages.

    For each window block ``j`` (``plan.block_size`` tokens) of a sequence the layer keeps one
    *record*: the ring rows of the block's tokens ``[2 (K, V), H_kv, block, d]``, then sink part
    ``j % sink_parts`` ``[2, H_kv, sink_part, d]``. Record row ``r`` lives in row
    ``r % rows_per_page`` of page ``tables[r // rows_per_page][j]``: a record spans
    ``plan.groups`` pages, one per window KV-cache group, each as large as one INT2 page.

    Attributes:
        rows: ``[num_blocks, rows_per_page, d]`` bf16 view of the layer's page buffer.
        num_kv_heads: KV heads of the layer (this rank's).
        plan: the record geometry.
        sink_tokens: the layout's sink length.
    """

    rows: torch.Tensor
    num_kv_heads: int
    plan: WindowPlan
    sink_tokens: int

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    @property
    def rows_per_page(self) -> int:
        return self.rows.shape[1]

    def _ring_row(self, kv: int, head: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return (kv * self.num_kv_heads + head) * self.block_size + offset

    def _sink_row(self, kv: int, head: torch.Tensor, within_part: torch.Tensor) -> torch.Tensor:
        base = 2 * self.num_kv_heads * self.block_size
        return base + (kv * self.num_kv_heads + head) * self.plan.sink_part + within_part

    def locate(
        self, tables: torch.Tensor, block: torch.Tensor, row: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """``(page, row in page)`` of record rows ``row`` of window blocks ``block``; ``tables``
        ``[G, max_blocks]`` (one sequence) broadcast with ``block`` and ``row``."""
        rpp = self.rows_per_page
        return tables[row // rpp, block].long(), row % rpp


def hit_window_positions(n_cached: int, sink: int, recent: int) -> list[int]:
    """Positions whose BF16 rows a request hitting ``n_cached`` tokens reads: ``[0, sink)`` and
    ``(n_cached - recent, n_cached)``, both cut to ``[0, n_cached)``."""
    head = list(range(min(sink, n_cached)))
    tail = range(bf16_ring_start(n_cached, sink, recent), n_cached)  # what the query at n_cached reads
    return head + list(tail)


def gather_columns(table: torch.Tensor, cols: list[set[int]]) -> list[list[dict[int, int]]]:
    """Entries ``table[..., r, c]`` for ``c in cols[r]`` as host dicts ``out[g][r][c]``, in one
    device-to-host copy (``table`` ``[B, W]`` gives ``g = 0`` only, ``[G, B, W]`` every ``g``)."""
    t = table if table.dim() == 3 else table[None]
    g, _, w = t.shape
    pairs = [(r, c) for r, cs in enumerate(cols) for c in sorted(cs)]
    if any(c >= w for _, c in pairs):
        raise OscarError(f"OSCAR: a row's positions lie past its block table ({w} blocks)")
    out: list[list[dict[int, int]]] = [[{} for _ in cols] for _ in range(g)]
    if not pairs:
        return out
    idx = torch.tensor([r * w + c for r, c in pairs], dtype=torch.long, device=t.device)
    vals = t[:, : len(cols)].reshape(g, -1)[:, idx].tolist()
    for k in range(g):
        for (r, c), x in zip(pairs, vals[k], strict=True):
            out[k][r][c] = int(x)
    return out


def scratch_ring(max_query_len: int) -> int:
    """Rows of the scratch ring that an extend step's window rows are written through: the
    chunk length rounded up to a power of two (at least 16), so a server compiles the write
    kernel for a handful of sizes instead of once per distinct chunk length."""
    return max(16, 1 << max(0, int(max_query_len) - 1).bit_length())


def write_window_pages(
    cache: PagedKVCache,
    params: object,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepPlan,
    pages: WindowPages,
    tables: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Store the step's BF16 window rows in ``pages`` (after :func:`run_layer`).

    ``tables``: ``[G, B, max_window_blocks]`` window block tables of the step's rows. Every
    written token's ring rows go to its window block's record, and with them that record's sink
    part (from the row's window slot; written at every token, so the last write of a full block
    is complete). The ring rows are the rows :func:`oscar_kernels.paged_write` puts in the ring:
    read back from the window slot when the step's longest chunk fits in the ring, else computed
    by that same write into a scratch ring as long as the chunk, so a restored row is bitwise the
    row a miss reads (:func:`oscar_kernels.write_window_records`). Padding tokens
    (``slot_mapping < 0``) write nothing. No host synchronisation on this path.
    """
    n = md.num_actual_tokens
    if n == 0:
        return
    lo = cache.layout
    b = md.seq_lens.shape[0]
    from_slot = int(md.max_query_len) <= lo.recent_tokens
    if from_slot:  # every row the step wrote is still in the slot (ring, or sink below ``sink``)
        ring_rows, k_src, v_src = md.window_slots, cache.k_recent, cache.v_recent
    else:
        # a power of two: the write kernel is compiled per ring size (a constexpr), and chunk
        # lengths vary with every prompt; rows of one chunk still never share a ring row
        ring = scratch_ring(int(md.max_query_len))
        scratch = allocate_cache(
            replace(lo, page_size=1, sink_tokens=0, recent_tokens=ring), 1, max(b, 1), cache.device
        )
        write_step(
            scratch,
            params,
            k[:n],
            v[:n],
            replace(
                md,
                slot_mapping=torch.where(md.slot_mapping[:n] >= 0, 0, -1).to(md.slot_mapping.dtype),
                window_slots=torch.arange(b, dtype=torch.int32, device=cache.device),
            ),
            backend,
            parts="ring",
            check_bounds=False,  # a scratch ring sized for this step's own rows
        )
        ring_rows = torch.arange(max(b, 1), dtype=torch.int32, device=cache.device)
        k_src, v_src = scratch.k_recent, scratch.v_recent
    plan = pages.plan
    write_window_records(
        pages.rows,
        tables,
        plan.block_size,
        plan.sink_part if lo.sink_tokens else 0,
        plan.sink_parts,
        md.slot_mapping[:n],
        md.seq_index[:n],
        md.positions[:n],
        md.window_slots,
        k_src,
        v_src,
        ring_rows,
        cache.k_sink,
        cache.v_sink,
        sink_in_ring=from_slot,
        backend=backend,
    )


def restore_windows(
    cache: PagedKVCache, slot: int, pages: WindowPages, tables: torch.Tensor, n_cached: int
) -> None:
    """Fill window slot ``slot`` with the rows a request with ``n_cached`` computed tokens reads
    (:func:`hit_window_positions`) from the records :func:`write_window_pages` stored;
    ``tables``: the request's ``[G, max_window_blocks]`` window block tables.

    Ring rows (and sink positions ``> n_cached - recent``) come from their own blocks' records;
    older sink positions from the sink parts of the ``sink_parts`` blocks ending at the block of
    position ``n_cached - 1`` (all held by vLLM's sliding-window manager)."""
    lo = cache.layout
    if n_cached <= 0:
        return
    dev = pages.rows.device
    tables = tables.to(dev).long()
    heads = torch.arange(lo.num_kv_heads, device=dev)[:, None]
    wb, plan = pages.block_size, pages.plan
    # which rows come from where is known on the host (positions only): the device gets one index
    # copy without waiting for the stream (a per-layer, per-hit synchronisation otherwise)
    want = hit_window_positions(n_cached, lo.sink_tokens, lo.recent_tokens)  # ascending
    cut = n_cached - lo.recent_tokens
    ring_pos = [p for p in want if p > cut]  # read from the position's own block's record
    old = [p for p in want if p <= cut]  # sink positions whose own block may have left the window
    n_sink = sum(p < lo.sink_tokens for p in ring_pos)  # the first ones (ascending)
    idx = to_device(torch.tensor(ring_pos + old, dtype=torch.int64), dev, True)
    if ring_pos:
        rp = idx[: len(ring_pos)]
        p = rp[None, :]
        blk = (p // wb).expand(lo.num_kv_heads, -1)
        for kv, sdst, rdst in ((0, cache.k_sink, cache.k_recent), (1, cache.v_sink, cache.v_recent)):
            page, off = pages.locate(tables, blk, pages._ring_row(kv, heads, p % wb))
            vals = pages.rows[page, off].to(rdst.device)  # [H, n, d]
            if n_sink:
                sdst[slot][:, rp[:n_sink].to(sdst.device)] = vals[:, :n_sink]
            if n_sink < len(ring_pos):
                rdst[slot][:, (rp[n_sink:] % lo.recent_tokens).to(rdst.device)] = vals[:, n_sink:]
    if old:
        o = idx[len(ring_pos) :]
        last = (n_cached - 1) // wb
        q = o // plan.sink_part
        blk = last - ((last - q) % plan.sink_parts)  # the held block with index % parts == q
        sp = (o - q * plan.sink_part)[None, :]
        for kv, dst in ((0, cache.k_sink), (1, cache.v_sink)):
            page, off = pages.locate(
                tables, blk[None, :].expand(lo.num_kv_heads, -1), pages._sink_row(kv, heads, sp)
            )
            dst[slot][:, o.to(dst.device)] = pages.rows[page, off].to(dst.device)


def _restore_index(
    lo: CacheLayout, pages: WindowPages, restore: Sequence[tuple[int, int, int]]
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Host index of a step's restores, the rows of :func:`restore_windows` for every ``(row,
    slot, n_cached)`` at once: int64 ``[7, N]`` — window group (page table), batch row, window
    block, row in the page, window slot, head, destination position — grouped by destination (K
    sink, V sink, K ring, V ring; the group bounds are returned beside it), rows in ``restore``'s
    order within a group. Built once per distinct ``n_cached`` (the hits of one shared prefix all
    have the same; ~5k entries at 8 KV heads) and repeated per row: 48 hits at 100k were 48 such
    builds and a sort of 245k entries (~30 ms on a 2-core CPU, 118 ms on the H100 machine's host
    with the first layer's gather)."""
    rows = [(row, slot, n) for row, slot, n in restore if n > 0]
    if not rows:
        return torch.zeros(7, 0, dtype=torch.int64), (0, 0, 0, 0, 0)
    per_n = {n: _restore_template(lo, pages, n) for n in dict.fromkeys(n for _, _, n in rows)}
    row_ids = torch.tensor([r for r, _, _ in rows], dtype=torch.int64)
    slot_ids = torch.tensor([s for _, s, _ in rows], dtype=torch.int64)
    out, bounds = [], [0]
    for g in range(4):  # K sink, V sink, K ring, V ring
        tpl = [per_n[n][g] for _, _, n in rows]
        sizes = torch.tensor([t.shape[1] for t in tpl])
        cols = torch.cat(tpl, dim=1)  # [5, n_g]: page group, block, row in page, head, position
        row = torch.repeat_interleave(row_ids, sizes)
        slot = torch.repeat_interleave(slot_ids, sizes)
        out.append(torch.stack([cols[0], row, cols[1], cols[2], slot, cols[3], cols[4]]))
        bounds.append(bounds[-1] + cols.shape[1])
    return torch.cat(out, dim=1).contiguous(), tuple(bounds)


def _restore_template(lo: CacheLayout, pages: WindowPages, n_cached: int) -> list[torch.Tensor]:
    """Per destination (K sink, V sink, K ring, V ring), int64 ``[5, n]``: page group, window
    block, row in the page, head, destination position of one row hitting ``n_cached`` tokens
    (entries in (K/V, head, position) order)."""
    h, wb, plan = lo.num_kv_heads, pages.block_size, pages.plan
    kv = torch.arange(2)[:, None, None]  # [2, 1, 1]
    head = torch.arange(h)[None, :, None]  # [1, H, 1]
    p = torch.tensor(hit_window_positions(n_cached, lo.sink_tokens, lo.recent_tokens))[None, None, :]
    own = p > n_cached - lo.recent_tokens  # in the position's own block's record
    last = (n_cached - 1) // wb
    q = p // max(plan.sink_part, 1)
    old_blk = last - ((last - q) % max(plan.sink_parts, 1))  # the held block with index % parts == q
    old_rec = 2 * h * wb + (kv * h + head) * plan.sink_part + (p - q * plan.sink_part)
    blk = torch.where(own, p // wb, old_blk)
    rec = torch.where(own, (kv * h + head) * wb + p % wb, old_rec)
    in_sink = p < lo.sink_tokens
    group = (kv + torch.where(in_sink, 0, 2)).expand_as(rec).reshape(-1)  # old positions: sink ones
    pos = torch.where(in_sink, p, p % max(lo.recent_tokens, 1))
    rpp = pages.rows_per_page  # the record row's page group and row in that page, on the host
    cols = [rec // rpp, blk, rec % rpp, head, pos]
    flat = torch.stack([c.expand_as(rec).reshape(-1) for c in cols]).long()
    return [flat[:, group == g] for g in range(4)]


def restore_window_rows(
    cache: PagedKVCache,
    pages: WindowPages,
    tables: torch.Tensor,
    restore: Sequence[tuple[int, int, int]],
    memo: dict | None = None,
) -> None:
    """:func:`restore_windows` for every ``(row, slot, n_cached)`` of a step at once: ``tables``
    ``[G, B, max_window_blocks]`` (the step's rows). The rows' positions are host-known, so the
    index is built on the host (once per step and geometry where ``memo`` is the step's dict: every
    layer of a configuration reads the same rows) and copied to the device without waiting for the
    stream; each layer then runs a gather and a store per destination (K/V sink, K/V ring) whatever
    the number of rows. Per row and layer the loop of :func:`restore_windows` issued ~30 small
    kernels and an index copy: 48 prefix hits in one step spent ~4 s on the host (H200, 12-04)."""
    if not restore:
        return
    lo = cache.layout
    plan = pages.plan
    key = (lo.num_kv_heads, lo.sink_tokens, lo.recent_tokens, pages.block_size, plan.sink_part,
           plan.sink_parts, str(pages.rows.device), tuple(restore))  # fmt: skip
    got = memo.get(key) if memo is not None else None
    if got is None:
        host, bounds = _restore_index(lo, pages, restore)
        got = (to_device(host, pages.rows.device, True), bounds)
        if memo is not None:
            memo[key] = got
    idx, bounds = got
    dests = (cache.k_sink, cache.v_sink, cache.k_recent, cache.v_recent)
    for g, dst in enumerate(dests):
        a, b = bounds[g], bounds[g + 1]
        if a == b:
            continue
        grp, row, blk, off, slot, head, pos = idx[:, a:b]
        vals = pages.rows[tables[grp, row, blk].long(), off]  # [n, d]
        dst[slot.to(dst.device), head.to(dst.device), pos.to(dst.device)] = vals.to(dst.device, dst.dtype)
