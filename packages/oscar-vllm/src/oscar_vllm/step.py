"""One engine step of the OSCAR backend, free of vLLM: metadata, window slots, the layer call.

:mod:`oscar_vllm.backend` adapts vLLM's objects to these functions; the GPU check script
(``benchmarks/gpu_check.py``) drives the same functions with vLLM-shaped tensors on a
machine without vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from oscar_kernels import PagedKVCache, allocate_cache, decode_attention, extend_attention, paged_write
from oscar_math.errors import OscarError

__all__ = [
    "StepMetadata",
    "WindowSlots",
    "build_step",
    "step_record",
    "write_step",
    "attend_step",
    "run_layer",
    "hit_window_positions",
    "write_window_pages",
    "restore_windows",
]


@dataclass
class StepMetadata:
    """One step's batch, shared by every layer (int32 on the model's device)."""

    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [B+1]
    seq_lens: torch.Tensor  # [B] after this step
    prefix_lens: torch.Tensor  # [B] cached before this step
    block_table: torch.Tensor  # [B, max_blocks]
    slot_mapping: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    seq_index: torch.Tensor  # [T]
    window_slots: torch.Tensor  # [B]
    all_decode: bool


class WindowSlots:
    """Window-pool row of every live request, for model runners that give no request row.

    Used while prefix caching is off (with caching on, slots are batch rows, restored every
    step from the window pages). Keyed by the request's first KV block, which no other live
    request holds while prefix caching is off. A request that starts (no cached
    tokens) takes a slot — its predecessor's if it got the same first block (that one
    has finished), else a free one, else the least recently seen slot of a request not
    in this batch. A request that continues must already have one: otherwise its BF16
    windows were never written here, and the step fails with one clear error instead of
    attending garbage.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # first block -> slot, LRU order
        self._free = list(range(num_slots - 1, -1, -1))

    def assign(self, first_blocks: list[int], starts: list[bool], active: list[bool]) -> list[int]:
        """Slots of a batch's rows (``0`` for inactive/padding rows)."""
        slots = [0] * len(first_blocks)
        in_batch = {b for b, a in zip(first_blocks, active, strict=True) if a}
        for i, (block, start, act) in enumerate(zip(first_blocks, starts, active, strict=True)):
            if not act:
                continue
            if block in self._slot_of:
                self._slot_of.move_to_end(block)
                slots[i] = self._slot_of[block]
                continue
            if not start:
                raise OscarError(
                    "OSCAR: a request arrived with cached tokens whose BF16 windows this worker never "
                    "wrote (a prefix-cache hit although OSCAR's exact prefix caching is not active; "
                    "see docs/vllm.md, 'Prefix caching')"
                )
            if not self._free:
                victim = next((b for b in self._slot_of if b not in in_batch), None)
                if victim is None:
                    raise OscarError(f"OSCAR: more than {self.num_slots} live requests (max_num_seqs)")
                self._free.append(self._slot_of.pop(victim))
            slot = self._free.pop()
            self._slot_of[block] = slot
            slots[i] = slot
        return slots


def build_step(
    query_start_loc: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_reqs: int,
    window_slots: torch.Tensor | None,
    slots: WindowSlots | None,
) -> StepMetadata:
    """:class:`StepMetadata` from vLLM's per-step tensors (``CommonAttentionMetadata`` fields).

    ``window_slots`` are the runner's persistent request rows when it has them; else
    ``slots`` assigns them from the first KV block of each row (host lists).
    """
    b = num_reqs
    dev = seq_lens.device
    qsl = query_start_loc[: b + 1].to(torch.int32)
    qsl_cpu = query_start_loc_cpu[: b + 1].to(torch.int64)
    q_lens_cpu = qsl_cpu[1:] - qsl_cpu[:-1]
    prefix_cpu = seq_lens_cpu[:b].to(torch.int64) - q_lens_cpu
    seq = seq_lens[:b].to(torch.int32)
    prefix = seq - (qsl[1:] - qsl[:-1])
    table = block_table[:b].to(torch.int32)
    if window_slots is not None:
        ws = window_slots[:b].to(device=dev, dtype=torch.int32)
    else:
        if slots is None:
            raise OscarError("OSCAR: no window slots for this batch")
        first = table[:, 0].cpu().tolist() if table.shape[1] else [0] * b
        ws = torch.tensor(
            slots.assign(first, (prefix_cpu == 0).tolist(), (q_lens_cpu > 0).tolist()),
            dtype=torch.int32,
            device=dev,
        )
    n = int(qsl_cpu[-1]) if b else 0
    tok = torch.arange(n, device=dev, dtype=torch.int32)
    seq_index = torch.searchsorted(qsl[1:], tok, right=True).to(torch.int32)
    positions = prefix[seq_index] + tok - qsl[seq_index]
    return StepMetadata(
        num_actual_tokens=n,
        max_query_len=int(q_lens_cpu.max()) if b else 0,
        query_start_loc=qsl,
        seq_lens=seq,
        prefix_lens=prefix,
        block_table=table,
        slot_mapping=slot_mapping[:n],
        positions=positions,
        seq_index=seq_index,
        window_slots=ws,
        all_decode=bool(b) and bool((q_lens_cpu <= 1).all()) and bool((prefix_cpu > 0).all()),
    )


def step_record(md: StepMetadata) -> dict:
    """A step's batch as host lists: per row the chunk length, the cached prefix before it,
    the window slot and the first KV block (what decides each sequence's outputs)."""
    qsl = md.query_start_loc.cpu().tolist()
    return {
        "query_lens": [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)],
        "prefix_lens": md.prefix_lens.cpu().tolist(),
        "window_slots": md.window_slots.cpu().tolist(),
        "first_blocks": md.block_table[:, 0].cpu().tolist() if md.block_table.shape[1] else [],
    }


def write_step(
    cache: PagedKVCache,
    params: object,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepMetadata,
    backend: str = "auto",
    parts: str = "all",
) -> None:
    """Quantise the step's ``k``/``v`` (``[T, H_kv, d]``) into ``cache`` (INT2 pages + BF16 windows).

    ``parts`` as :func:`oscar_kernels.paged_write`: :func:`run_layer` writes ``"all"`` before
    a decode-only step, ``"pages"`` before and ``"ring"`` after an extend step.
    """
    ws = md.window_slots
    paged_write(
        cache,
        params,
        k,
        v,
        md.slot_mapping,
        md.positions,
        md.seq_index,
        md.seq_lens,
        ws,
        backend=backend,
        parts=parts,
    )


def attend_step(
    cache: PagedKVCache,
    params: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepMetadata,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """Attention of the step's queries over the cache (after :func:`write_step`).

    Decode kernel when every row is a one-token decode (everything written before);
    otherwise one extend call over the whole mixed batch (a decode row is a one-token
    chunk; extend and decode agree there, see oscar-kernels' tests), after the INT2 +
    sink write and before the ring write. Returns ``[T, H_q, d]`` in ``q.dtype``.
    """
    if md.all_decode:
        return decode_attention(
            q,
            cache,
            params,
            md.block_table,
            md.seq_lens,
            md.window_slots,
            softmax_scale=scale,
            backend=backend,
        )
    return extend_attention(
        q,
        k,
        v,
        cache,
        params,
        md.query_start_loc,
        md.prefix_lens,
        md.block_table,
        md.window_slots,
        md.max_query_len,
        softmax_scale=scale,
        backend=backend,
    )


def run_layer(
    cache: PagedKVCache,
    params: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepMetadata,
    scale: float,
    backend: str = "auto",
) -> torch.Tensor:
    """One layer's step (what the backend runs): write, attend, and for an extend step the
    ring rows last — the windows apply per query token (``oscar_kernels.extend_attention``),
    and a chunk's ring rows overwrite rows its first queries still read."""
    if md.all_decode:
        write_step(cache, params, k, v, md, backend)
        return attend_step(cache, params, q, k, v, md, scale, backend)
    write_step(cache, params, k, v, md, backend, parts="pages")
    out = attend_step(cache, params, q, k, v, md, scale, backend)
    write_step(cache, params, k, v, md, backend, parts="ring")
    return out


# ---- BF16 window rows in pages: what a prefix-cache hit needs (docs/vllm.md, "Prefix caching") --
#
# Query ``t`` reads key ``j`` in BF16 iff ``j < sink`` or ``j > t - recent``. A request that hits
# ``N`` cached tokens computes queries ``t >= N`` only, so besides the shared INT2 pages it needs
# the BF16 rows of positions ``[0, sink)`` and ``(N - recent, N)`` — rows that depend only on the
# prefix's tokens. Kept in pages that the engine's prefix cache shares like KV blocks (a
# sliding-window KV-cache group, so blocks leave once no query can read them), a hit restores
# exactly these rows into a window slot and then computes what a miss computes.


@dataclass
class WindowPages:
    """One layer's BF16 window rows inside engine pages.

    For each token block ``j`` of a sequence the layer keeps one *record*: the ring rows of the
    block's tokens, ``[2 (K, V), H_kv, block_size, d]``, then a copy of the sequence's sink rows
    ``[2, H_kv, sink, d]`` (so any block of the window carries the sink). Record row ``r`` lives
    in row ``r % rows_per_page`` of page ``tables[r // rows_per_page][j]``: a record spans
    :meth:`groups` pages, one per window KV-cache group, each as large as one INT2 page.

    Attributes:
        rows: ``[num_blocks, rows_per_page, d]`` bf16 view of the layer's page buffer.
        num_kv_heads, block_size, sink_tokens: the record's geometry.
    """

    rows: torch.Tensor
    num_kv_heads: int
    block_size: int
    sink_tokens: int

    @staticmethod
    def record_rows(num_kv_heads: int, block_size: int, sink_tokens: int) -> int:
        """Rows (of ``d`` bf16) in one block's record."""
        return 2 * num_kv_heads * (block_size + sink_tokens)

    @staticmethod
    def groups_for(num_kv_heads: int, block_size: int, sink_tokens: int, rows_per_page: int) -> int:
        """Pages (window groups) one record needs."""
        return -(-WindowPages.record_rows(num_kv_heads, block_size, sink_tokens) // rows_per_page)

    @property
    def rows_per_page(self) -> int:
        return self.rows.shape[1]

    def _ring_row(self, kv: int, head: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        return (kv * self.num_kv_heads + head) * self.block_size + offset

    def _sink_row(self, kv: int, head: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        base = 2 * self.num_kv_heads * self.block_size
        return base + (kv * self.num_kv_heads + head) * self.sink_tokens + pos

    def locate(
        self, tables: torch.Tensor, block: torch.Tensor, row: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """``(page, row in page)`` of record rows ``row`` of token blocks ``block``; ``tables``
        ``[G, max_blocks]`` (one sequence) broadcast with ``block`` and ``row``."""
        rpp = self.rows_per_page
        return tables[row // rpp, block].long(), row % rpp


def hit_window_positions(n_cached: int, sink: int, recent: int) -> list[int]:
    """Positions whose BF16 rows a request hitting ``n_cached`` tokens reads: ``[0, sink)`` and
    ``(n_cached - recent, n_cached)``, both cut to ``[0, n_cached)``."""
    head = list(range(min(sink, n_cached)))
    tail = range(max(sink, n_cached - recent + 1), n_cached)
    return head + list(tail)


def write_window_pages(
    cache: PagedKVCache,
    params: object,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepMetadata,
    pages: WindowPages,
    tables: torch.Tensor,
    backend: str = "auto",
) -> None:
    """Store the step's BF16 window rows in ``pages`` (after :func:`run_layer`).

    ``tables``: ``[G, B, max_blocks]`` window block tables of the step's rows. Every written token
    goes to its block's record; every record the step touched gets the sequence's sink rows
    (from its window slot). The ring rows are those :func:`oscar_kernels.paged_write` puts in
    a ring, computed by that same write into a scratch ring as long as the step's longest
    chunk, so a restored row is bitwise the row a miss reads.
    """
    n = md.num_actual_tokens
    if n == 0:
        return
    b = md.seq_lens.shape[0]
    ring = max(int(md.max_query_len), 1)
    scratch = allocate_cache(
        replace(cache.layout, page_size=1, sink_tokens=0, recent_tokens=ring), 1, max(b, 1), cache.device
    )
    valid = md.slot_mapping[:n] >= 0
    write_step(
        scratch,
        params,
        k[:n],
        v[:n],
        replace(
            md,
            slot_mapping=torch.where(valid, 0, -1).to(md.slot_mapping.dtype),
            window_slots=torch.arange(b, dtype=torch.int32, device=cache.device),
        ),
        backend,
        parts="ring",
    )
    dev = pages.rows.device
    sidx = md.seq_index[:n].long()[valid].to(dev)
    pos = md.positions[:n].long()[valid].to(dev)
    if pos.numel() == 0:
        return
    tables = tables.to(dev).long()
    heads = torch.arange(pages.num_kv_heads, device=dev)
    bs, rpp = pages.block_size, pages.rows_per_page
    block = (pos // bs)[:, None]
    for kv, src in ((0, scratch.k_recent), (1, scratch.v_recent)):
        r = pages._ring_row(kv, heads[None, :], (pos % bs)[:, None])  # [n, H]
        page = tables[r // rpp, sidx[:, None], block]
        pages.rows[page, r % rpp] = src[sidx, :, (pos % ring)].to(dev)
    if pages.sink_tokens == 0:
        return
    s = torch.arange(pages.sink_tokens, device=dev)
    for row in torch.unique(sidx).tolist():
        slot = int(md.window_slots[row])
        for j in torch.unique(pos[sidx == row] // bs).tolist():
            for kv, src in ((0, cache.k_sink), (1, cache.v_sink)):
                r = pages._sink_row(kv, heads[:, None], s[None, :])  # [H, sink]
                page, off = pages.locate(tables[:, row], torch.full_like(r, j), r)
                pages.rows[page, off] = src[slot].to(dev)


def restore_windows(
    cache: PagedKVCache, slot: int, pages: WindowPages, tables: torch.Tensor, n_cached: int
) -> None:
    """Fill window slot ``slot`` with the rows a request with ``n_cached`` computed tokens reads
    (:func:`hit_window_positions`) from the records :func:`write_window_pages` stored;
    ``tables``: the request's ``[G, max_blocks]`` window block tables."""
    lo = cache.layout
    if n_cached <= 0:
        return
    dev = pages.rows.device
    tables = tables.to(dev).long()
    heads = torch.arange(lo.num_kv_heads, device=dev)[:, None]
    bs = pages.block_size
    want = torch.tensor(hit_window_positions(n_cached, lo.sink_tokens, lo.recent_tokens), device=dev)
    n_sink = int((want < lo.sink_tokens).sum())
    if n_sink:  # from the record of the block holding position n_cached - 1
        s = torch.arange(n_sink, device=dev)[None, :]
        last = torch.full((lo.num_kv_heads, n_sink), (n_cached - 1) // bs, device=dev)
        for kv, dst in ((0, cache.k_sink), (1, cache.v_sink)):
            page, off = pages.locate(tables, last, pages._sink_row(kv, heads, s))
            dst[slot, :, :n_sink] = pages.rows[page, off].to(dst.device)
    tail = want[want >= lo.sink_tokens].long()
    if tail.numel() and lo.recent_tokens:
        p = tail[None, :]
        for kv, dst in ((0, cache.k_recent), (1, cache.v_recent)):
            page, off = pages.locate(
                tables, (p // bs).expand(lo.num_kv_heads, -1), pages._ring_row(kv, heads, p % bs)
            )
            dst[slot][:, (tail % lo.recent_tokens).to(dst.device)] = pages.rows[page, off].to(dst.device)
