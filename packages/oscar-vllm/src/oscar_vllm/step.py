"""One engine step of the OSCAR backend, free of vLLM: metadata, window slots, the layer call.

:mod:`oscar_vllm.backend` adapts vLLM's objects to these functions; the GPU check script
(``benchmarks/gpu_check.py``) drives the same functions with vLLM-shaped tensors on a
machine without vLLM.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from oscar_kernels import (
    DenseAttention,
    PagedKVCache,
    allocate_cache,
    decode_attention,
    extend_attention,
    paged_write,
    write_window_records,
)
from oscar_math import bf16_ring_start
from oscar_math.errors import OscarError

__all__ = [
    "StepMetadata",
    "WindowSlots",
    "build_step",
    "StepBuffers",
    "step_record",
    "write_step",
    "attend_step",
    "run_layer",
    "hit_window_positions",
    "WindowPlan",
    "WindowPages",
    "plan_window_records",
    "window_sink_parts",
    "write_window_pages",
    "restore_windows",
    "SlotTracker",
    "plan_slots",
    "RecordStamps",
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
    #: rows whose window slot must be restored before the layer runs: ``(row, slot, prefix)``
    #: (prefix caching; :class:`SlotTracker`)
    restore: tuple[tuple[int, int, int], ...] = ()
    #: transient window records: the builder's stamps and this step's number (checked once per
    #: step by the first layer, :class:`RecordStamps`)
    stamps: RecordStamps | None = None
    step_no: int = 0
    #: set by the first layer that checked the step's index tensors against its cache: every layer
    #: of a step shares them, so the others skip the checks (each is a host synchronisation)
    bounds_checked: list[bool] = field(default_factory=lambda: [False])
    #: the layers (ids) whose windows the metadata builders already restored for this step
    restored_by: set[int] = field(default_factory=set)
    #: the window groups' block tables stacked ``[G, B, max_blocks]``, by the ids of the groups'
    #: metadata: every layer of a step reads the same groups, so one stack per step, not per layer
    window_tables: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)
    #: per row on the host: query tokens (exact) and an upper bound of ``seq_lens`` (vLLM's V2
    #: runner gives bounds): they size a dense prefill's packed keys without a synchronisation
    query_lens_host: tuple[int, ...] = ()
    seq_lens_bound_host: tuple[int, ...] = ()


class WindowSlots:
    """Window-pool row of every live request, for model runners that give no request row.

    Used while prefix caching is off (with caching on, :class:`SlotTracker` keys slots by their
    content and restores from the window pages where needed). Keyed by the request's first KV
    block, which no other live request holds while prefix caching is off. A request that starts (no cached
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


class RequestSlots:
    """Window slot of every running request, by request id, for vLLM's V1 model runner.

    The V1 runner gives the attention backend no persistent request row, but it tells its worker
    in every scheduler output which requests finished or were preempted
    (:func:`oscar_vllm.compat.track_v1_requests` passes them here, with the step's rows in batch
    order). A request takes the slot free the longest at its first step (so a slot's reuse
    comes late, and the tests see requests in several slots) and keeps it until it finishes or
    is preempted, however many steps vLLM skips it; vLLM runs at most
    ``max_num_seqs`` requests at once, so a free slot always exists and a running request never
    loses its windows. A preempted or resumed request comes back as a new one (vLLM recomputes
    it, or serves it from a prefix hit whose window records it has checked).
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: dict[str, int] = {}
        self._free = deque(range(num_slots))  # released slots go to the back
        #: this step's slots in batch order, ``None`` outside a step (dummy and capture runs)
        self.rows: list[int] | None = None
        #: per slot, how many requests it has been given (:class:`FreshRows` reads it)
        self.generation: dict[int, int] = {}

    def step(self, ended: Iterable[str], row_ids: Sequence[str]) -> list[int]:
        """Release the slots of ``ended`` requests, then give each row its request's slot."""
        for rid in sorted(ended):  # sorted: the same slots in every run
            slot = self._slot_of.pop(rid, None)
            if slot is not None:
                self._free.append(slot)
        rows = []
        for rid in row_ids:
            slot = self._slot_of.get(rid)
            if slot is None:
                if not self._free:
                    raise OscarError(f"OSCAR: more than {self.num_slots} running requests (max_num_seqs)")
                slot = self._slot_of[rid] = self._free.popleft()
                self.generation[slot] = self.generation.get(slot, 0) + 1
            rows.append(slot)
        self.rows = rows
        return rows

    def end_step(self) -> None:
        self.rows = None

    def rows_for(self, num_reqs: int) -> list[int] | None:
        """This step's slots for a batch of ``num_reqs`` rows, else ``None`` (no step running, or a
        batch of other requests). Rows past the step's requests are the runner's padding (a CUDA
        graph's batch size): slot 0, which they never write (no tokens)."""
        if self.rows is None or num_reqs < len(self.rows):
            return None
        return self.rows + [0] * (num_reqs - len(self.rows))


class FreshRows:
    """Which of a step's window slots hold a request that has not run a step in them yet.

    Where slots follow request identity (vLLM V2's persistent rows, :class:`RequestSlots` on the
    V1 runner) a slot is exclusive to its request from its first step until it finishes, so it
    holds that request's windows at every later step. A restore is then needed exactly at a
    request's first step in its slot, and only with cached tokens (a prefix hit, or a resumed
    request). The model-runner hook (or :class:`RequestSlots`) counts the requests each slot was
    given (``generation``); this object remembers the count it saw last per slot. Deciding this
    needs no block ids, so a step reads nothing back from the device (:func:`plan_slots` does).
    """

    def __init__(self, generation: dict[int, int]) -> None:
        self.generation = generation  # shared with the hook, which only ever increments it
        self._seen: dict[int, int] = {}

    def plan(
        self,
        query_start_loc_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        rows: Sequence[int],
        num_reqs: int,
    ) -> tuple[list[int], list[tuple[int, int, int]]]:
        """Slots of a batch's rows (padding rows, which have no tokens: slot 0) and the rows to
        restore, ``(row, slot, prefix)``, as :func:`plan_slots` returns them."""
        b = num_reqs
        qsl = query_start_loc_cpu[: b + 1].tolist()
        seq = seq_lens_cpu[:b].tolist()
        slots, restore = [0] * b, []
        for i in range(b):
            qlen = qsl[i + 1] - qsl[i]
            if qlen <= 0 or seq[i] <= 0:
                continue
            slot = int(rows[i])
            slots[i] = slot
            gen = self.generation.get(slot, 0)
            if self._seen.get(slot) != gen:  # the slot's request runs its first step
                self._seen[slot] = gen
                prefix = int(seq[i]) - qlen
                if prefix > 0:
                    restore.append((i, slot, prefix))
        return slots, restore


def _to_device(host: torch.Tensor, dev: torch.device, async_copy: bool) -> torch.Tensor:
    """``host`` on ``dev``; with ``async_copy`` without waiting for the stream: a blocking copy from
    pageable memory ends in a stream synchronisation, which makes the step's metadata build wait for
    the previous step's kernels. Pinned memory and ``non_blocking`` (the host allocator keeps the
    buffer until the copy has run)."""
    if not async_copy or dev.type != "cuda" or host.device.type != "cpu":
        return host.to(dev)
    return host.pin_memory().to(dev, non_blocking=True)


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
    num_tokens: int | None = None,
    async_copy: bool = False,
) -> StepMetadata:
    """:class:`StepMetadata` from vLLM's per-step tensors (``CommonAttentionMetadata`` fields).

    ``window_slots`` are the runner's persistent request rows when it has them; else
    ``slots`` assigns them from the first KV block of each row (host lists). ``num_tokens``:
    vLLM's token count including CUDA-graph padding (``num_actual_tokens``; padding tokens have
    slot ``-1`` and belong to no row): the token tensors cover it, so a graph captured at that
    size never reads stale entries. ``async_copy``: the window slots go to the device without a
    stream synchronisation (where nothing else in the build reads the device).
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
        ws = _to_device(window_slots[:b].to(torch.int32), dev, async_copy)
    else:
        if slots is None:
            raise OscarError("OSCAR: no window slots for this batch")
        first = table[:, 0].cpu().tolist() if table.shape[1] else [0] * b
        ws = torch.tensor(
            slots.assign(first, (prefix_cpu == 0).tolist(), (q_lens_cpu > 0).tolist()),
            dtype=torch.int32,
            device=dev,
        )
    n = max(int(qsl_cpu[-1]) if b else 0, num_tokens or 0)
    tok = torch.arange(n, device=dev, dtype=torch.int32)
    # padding tokens (past the last row's end) are given to the last row; their slot is -1
    seq_index = torch.searchsorted(qsl[1:], tok, right=True).clamp_(max=max(b - 1, 0)).to(torch.int32)
    positions = prefix[seq_index] + tok - qsl[seq_index] if b else tok
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
        # padding rows (no tokens: vLLM's CUDA-graph padding) do not make a batch an extend;
        # a one-token first step is a decode too (the decode kernel attends its own key)
        all_decode=bool(b) and bool((q_lens_cpu <= 1).all()) and bool((q_lens_cpu == 1).any()),
        query_lens_host=tuple(q_lens_cpu.tolist()),
        seq_lens_bound_host=tuple(seq_lens_cpu[:b].tolist()),
    )


class StepBuffers:
    """Persistent device tensors that every step's :class:`StepMetadata` lives in.

    A FULL CUDA graph replays the kernel launches with the tensor addresses seen at capture,
    while vLLM builds each step's metadata eagerly before the replay; the builder therefore
    copies each step's metadata into these buffers (sized for ``max_reqs`` rows and
    ``max_tokens`` tokens) instead of handing over fresh tensors.
    """

    def __init__(self, max_reqs: int, max_tokens: int, device: torch.device) -> None:
        def z(n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=device)

        self.max_reqs, self.max_tokens = max_reqs, max_tokens
        self.query_start_loc, self.seq_lens, self.prefix_lens = z(max_reqs + 1), z(max_reqs), z(max_reqs)
        self.window_slots = z(max_reqs)
        self.positions, self.seq_index = z(max_tokens), z(max_tokens)
        self.slot_mapping = z(max_tokens, torch.int64)
        self.block_table: torch.Tensor | None = None

    def hold(self, md: StepMetadata) -> StepMetadata:
        """``md`` with every tensor copied into (a view of) these buffers."""
        b, n = md.seq_lens.shape[0], md.num_actual_tokens
        if b > self.max_reqs or n > self.max_tokens:
            raise OscarError(
                f"OSCAR: a step of {b} rows / {n} tokens exceeds {self.max_reqs} / {self.max_tokens}"
            )
        w = md.block_table.shape[1]
        if self.block_table is None or self.block_table.shape[1] != w:
            self.block_table = torch.zeros(self.max_reqs, w, dtype=torch.int32, device=md.block_table.device)

        def put(buf: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            view = buf[: t.shape[0]]
            view.copy_(t, non_blocking=True)
            return view

        return replace(
            md,
            query_start_loc=put(self.query_start_loc, md.query_start_loc),
            seq_lens=put(self.seq_lens, md.seq_lens),
            prefix_lens=put(self.prefix_lens, md.prefix_lens),
            block_table=put(self.block_table, md.block_table),
            slot_mapping=put(self.slot_mapping, md.slot_mapping[:n]),
            positions=put(self.positions, md.positions),
            seq_index=put(self.seq_index, md.seq_index),
            window_slots=put(self.window_slots, md.window_slots),
        )


def step_record(md: StepMetadata) -> dict:
    """A step's batch as host lists: per row the chunk length, the cached prefix before it,
    the window slot and the first KV block (what decides each sequence's outputs), and the rows
    whose window slot was restored (prefix caching)."""
    qsl = md.query_start_loc.cpu().tolist()
    return {
        "query_lens": [b - a for a, b in zip(qsl[:-1], qsl[1:], strict=True)],
        "prefix_lens": md.prefix_lens.cpu().tolist(),
        "window_slots": md.window_slots.cpu().tolist(),
        "first_blocks": md.block_table[:, 0].cpu().tolist() if md.block_table.shape[1] else [],
        "restored": [row for row, _, _ in md.restore],
    }


def write_step(
    cache: PagedKVCache,
    params: object,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepMetadata,
    backend: str = "auto",
    parts: str = "all",
    check_bounds: bool | None = None,
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
        check_bounds=check_bounds,
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
    check_bounds: bool | None = None,
    dense: DenseAttention | None = None,
    out: torch.Tensor | None = None,
    extend_splits: int | str = 1,
) -> torch.Tensor:
    """Attention of the step's queries over the cache (after :func:`write_step`).

    Decode kernel when every row is a one-token decode (everything written before);
    otherwise one extend call over the whole mixed batch (a decode row is a one-token
    chunk; extend and decode agree there, see oscar-kernels' tests), after the INT2 +
    sink write and before the ring write. Returns ``[T, H_q, d]`` in ``q.dtype``; a decode step
    writes it into ``out`` when given (contiguous, as ``q``), other steps return a new tensor.
    ``extend_splits``: :func:`oscar_kernels.extend_attention`'s ``num_splits``.
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
            check_bounds=check_bounds,
            out=out,
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
        check_bounds=check_bounds,
        dense=dense,
        host_lens=(md.query_lens_host, md.seq_lens_bound_host) if md.query_lens_host else None,
        num_splits=extend_splits,
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
    dense: DenseAttention | None = None,
    out: torch.Tensor | None = None,
    extend_splits: int | str = 1,
) -> torch.Tensor:
    """One layer's step (what the backend runs): write, attend, and for an extend step the
    ring rows last — the windows apply per query token (``oscar_kernels.extend_attention``),
    and a chunk's ring rows overwrite rows its first queries still read. ``out``: as
    :func:`attend_step`."""
    # the step's index tensors are the same for every layer: the first layer checks them against
    # its cache (host synchronisations), the others skip the checks
    cb = False if md.bounds_checked[0] else None
    if md.all_decode:
        write_step(cache, params, k, v, md, backend, check_bounds=cb)
        res = attend_step(cache, params, q, k, v, md, scale, backend, check_bounds=cb, out=out)
    else:
        write_step(cache, params, k, v, md, backend, parts="pages", check_bounds=cb)
        res = attend_step(
            cache,
            params,
            q,
            k,
            v,
            md,
            scale,
            backend,
            check_bounds=cb,
            dense=dense,
            extend_splits=extend_splits,
        )
        write_step(cache, params, k, v, md, backend, parts="ring", check_bounds=cb)
    md.bounds_checked[0] = True
    return res


# ---- BF16 window rows in pages: what a prefix-cache hit needs (docs/vllm.md, "Prefix caching") --
#
# Query ``t`` reads key ``j`` in BF16 iff ``j < sink`` or ``j > t - recent``. A request that hits
# ``N`` cached tokens computes queries ``t >= N`` only, so besides the shared INT2 pages it needs
# the BF16 rows of positions ``[0, sink)`` and ``(N - recent, N)`` — rows that depend only on the
# prefix's tokens. Kept in pages that the engine's prefix cache shares like KV blocks (a
# sliding-window KV-cache group, so blocks leave once no query can read them), a hit restores
# exactly these rows into a window slot and then computes what a miss computes.


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
    md: StepMetadata,
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
    idx = _to_device(torch.tensor(ring_pos + old, dtype=torch.int64), dev, True)
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


# ---- which rows need a restore: window slots that follow their content -------------------------


class SlotTracker:
    """What each window slot holds, so a request restores its windows only when its slot does
    not already hold them (docs/vllm.md, "Prefix caching").

    A slot's content is named by the key ``(INT2 block of position p - 1, p)`` of the step that
    last wrote it: a block full and cached names its whole prefix (vLLM hashes the chain), a
    partial block has one owner. A block that is written through another slot gets a new content,
    so every slot whose key names it is forgotten. A request whose key matches a slot reuses it
    without a restore; any other request with cached tokens (a prefix hit, a resumed or moved
    request) takes a free or least recently used slot and restores it from the window records,
    which vLLM's sliding-window manager keeps for every running request.
    """

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.key: list[tuple[int, int] | None] = [None] * num_slots
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self.restores = 0  # rows restored so far (diagnostics, tests)

    def plan(
        self,
        last_block_before: list[int],
        prefix: list[int],
        last_block_after: list[int],
        seq: list[int],
        written_blocks: list[set[int]],
        active: list[bool],
        fixed: list[int] | None = None,
    ) -> tuple[list[int], list[bool]]:
        """Slots of a batch's rows and whether each must be restored; records the step's writes.

        Per row: the INT2 block of position ``prefix - 1`` (any value when ``prefix == 0``),
        ``prefix``, the block of position ``seq - 1``, ``seq``, the INT2 blocks the step writes,
        and whether the row is real (padding rows get slot 0, no restore). ``fixed``: slots
        given by the model runner (vLLM V2's ``req_idx``), else chosen here.
        """
        b = len(prefix)
        slots, restore = [0] * b, [False] * b
        taken: set[int] = set()
        want = [(last_block_before[i], prefix[i]) if prefix[i] > 0 else None for i in range(b)]
        if fixed is not None:
            for i in range(b):
                if active[i]:
                    slots[i] = fixed[i]
                    taken.add(fixed[i])
                    restore[i] = want[i] is not None and self.key[fixed[i]] != want[i]
        else:
            by_key: dict[tuple[int, int], list[int]] = {}
            for s, k in enumerate(self.key):
                if k is not None:
                    by_key.setdefault(k, []).append(s)
            pending = []
            for i in range(b):
                if not active[i]:
                    continue
                match = [s for s in by_key.get(want[i], []) if s not in taken] if want[i] else []
                if match:
                    slots[i] = match[0]
                    taken.add(match[0])
                else:
                    pending.append(i)
            for i in pending:  # free slots first, then the least recently used
                free = [s for s in self._lru if s not in taken and self.key[s] is None]
                rest = [s for s in self._lru if s not in taken]
                if not rest:
                    raise OscarError(f"OSCAR: more than {self.num_slots} requests in one step (max_num_seqs)")
                slots[i] = (free or rest)[0]
                taken.add(slots[i])
                restore[i] = want[i] is not None
        written = set().union(*(written_blocks[i] for i in range(b) if active[i])) if b else set()
        for s in range(self.num_slots):  # contents overwritten through another slot
            k = self.key[s]
            if k is not None and s not in taken and k[0] in written:
                self.key[s] = None
        for i in range(b):
            if active[i]:
                self.key[slots[i]] = (last_block_after[i], seq[i])
                self._lru.move_to_end(slots[i])
        self.restores += sum(restore)
        return slots, restore


def plan_slots(
    tracker: SlotTracker,
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int,
    block_size: int,
    fixed: list[int] | None = None,
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Window slots of a batch's rows and the rows to restore, ``(row, slot, prefix)``, from vLLM's
    per-step tensors (prefix caching; :class:`SlotTracker`).

    ``block_table``: the INT2 group's ``[B, max_blocks]`` table of ``block_size``-token blocks
    (any device): only the entries the tracker needs (the blocks of positions ``prefix - 1`` and
    ``seq - 1`` and the blocks the step writes) are gathered and copied to the host, in one copy.
    """
    b = num_reqs
    qsl = query_start_loc_cpu[: b + 1].tolist()
    seq = [int(x) for x in seq_lens_cpu[:b].tolist()]
    qlen = [qsl[i + 1] - qsl[i] for i in range(b)]
    prefix = [seq[i] - qlen[i] for i in range(b)]
    width = int(block_table.shape[1]) if block_table.dim() == 2 else 0
    cols: list[list[int]] = []
    for i in range(b):
        if qlen[i] <= 0 or seq[i] <= 0:
            cols.append([])
            continue
        before = [(prefix[i] - 1) // block_size] if prefix[i] > 0 else []
        cols.append(before + list(range(prefix[i] // block_size, (seq[i] - 1) // block_size + 1)))
    flat = [i * width + c for i, cs in enumerate(cols) for c in cs if c < width]
    if len(flat) != sum(len(cs) for cs in cols):
        raise OscarError(f"OSCAR: a row's positions lie past its block table ({width} blocks)")
    vals = block_table[:b].reshape(-1)[torch.tensor(flat, dtype=torch.long, device=block_table.device)]
    vals = vals.tolist() if flat else []
    blocks_before, blocks_after, written, k = [-1] * b, [-1] * b, [set() for _ in range(b)], 0
    for i, cs in enumerate(cols):
        if not cs:
            continue
        got = vals[k : k + len(cs)]
        k += len(cs)
        if prefix[i] > 0:
            blocks_before[i], got = int(got[0]), got[1:]
        written[i] = {int(x) for x in got}
        blocks_after[i] = int(got[-1])
    slots, again = tracker.plan(
        blocks_before, prefix, blocks_after, seq, written, [q > 0 for q in qlen], fixed
    )
    return slots, [(i, slots[i], prefix[i]) for i in range(b) if again[i]]


# ---- transient window records: which records are still intact ---------------------------------


class RecordStamps:
    """Which window records still hold what a restore would read (transient records only).

    With transient records (:mod:`oscar_vllm.records`) vLLM frees a running request's window
    blocks once written; they stay cached for hits but can be evicted and reused, as window
    blocks of other positions or as INT2 pages. A hit is only accepted while its records are
    cached, and on vLLM's V2 runner a running request never restores; on the V1 runner a
    request that lost its window slot would restore from its own records, which may be gone.
    This check makes that an error instead of wrong numbers: every record a restore reads must
    carry the stamp written with it.

    The stamp of window block ``b`` is ``(X, j, g)``: the INT2 block ``X`` that held the record's
    tokens when it was written, the window index ``j`` (positions ``[j*wb, (j+1)*wb)``) and the
    record page ``g``. A full INT2 block is immutable while any request holds it (vLLM's prefix
    cache shares it by a hash of the whole prefix), and a partial one has one owner, so a
    record whose stamp matches the restoring request's INT2 block ``X`` at ``j`` holds that
    request's rows. A stamp is dropped when ``b`` is written as an INT2 page, when another
    record of ``(X, j, g)`` is written (``X`` was freed and reused), and overwritten when ``b``
    holds another record.
    """

    def __init__(self) -> None:
        self.geometry: tuple[int, ...] | None = None
        self._stamp: dict[int, tuple[int, int, int]] = {}
        self._where: dict[tuple[int, int, int], int] = {}
        self.last_step = -1  # the step whose check ran (the other layers of that step skip it)
        self.checked = 0  # records checked so far (diagnostics, tests)

    def configure(self, window_block: int, int2_block: int, sink: int, recent: int, sink_parts: int) -> None:
        """Set the record geometry (the layers' :class:`WindowPlan`; the same for every layer)."""
        geometry = (window_block, int2_block, sink, recent, sink_parts)
        if self.geometry is not None and self.geometry != geometry:
            raise OscarError(f"OSCAR: window records of two geometries {self.geometry} / {geometry}")
        self.geometry = geometry
        self.wb, self.ib, self.sink, self.recent, self.parts = geometry

    def needed(self, n_cached: int) -> range:
        """Window indices whose records a restore at ``n_cached`` reads (:func:`restore_windows`)."""
        if n_cached <= 0:
            return range(0)
        last = (n_cached - 1) // self.wb
        ring_lo = max(0, n_cached - self.recent + 1)
        lo = ring_lo // self.wb
        if min(self.sink, n_cached) > ring_lo:  # older sink positions: parts of the last S blocks
            lo = min(lo, max(0, last - self.parts + 1))
        return range(lo, last + 1)

    def columns(
        self, prefix: list[int], seq: list[int], restore_rows: list[int]
    ) -> tuple[list[set[int]], list[set[int]]]:
        """The INT2 and window block-table columns :meth:`step` reads per row: the records a
        restore checks and the blocks the step writes (a few per row, not the whole table)."""
        wb, ib = self.wb, self.ib
        int2: list[set[int]] = [set() for _ in prefix]
        win: list[set[int]] = [set() for _ in prefix]
        for r in restore_rows:
            for j in self.needed(prefix[r]):
                win[r].add(j)
                int2[r].add((j * wb) // ib)
        for r, (p, n) in enumerate(zip(prefix, seq, strict=True)):
            if n <= p:
                continue
            int2[r].update(range(p // ib, (n - 1) // ib + 1))
            for j in range(p // wb, (n - 1) // wb + 1):
                win[r].add(j)
                int2[r].add((j * wb) // ib)
        return int2, win

    def _drop(self, b: int) -> None:
        key = self._stamp.pop(b, None)
        if key is not None and self._where.get(key) == b:
            del self._where[key]

    def step(
        self,
        step_no: int,
        int2_tables: list[list[int]],
        window_tables: list[list[list[int]]],
        prefix: list[int],
        seq: list[int],
        restore_rows: list[int],
    ) -> None:
        """Check this step's restores, then record its writes (once per ``step_no``).

        ``int2_tables[r]``: row ``r``'s INT2 block ids; ``window_tables[g][r]``: its window
        blocks of record page ``g``; ``prefix`` / ``seq``: tokens before / after the step.
        Raises :class:`OscarError` for a restore whose records are not intact."""
        if step_no == self.last_step:
            return
        self.last_step = step_no
        wb, ib = self.wb, self.ib
        for r in restore_rows:
            for j in self.needed(prefix[r]):
                x = int2_tables[r][(j * wb) // ib]
                for g, tables in enumerate(window_tables):
                    b = tables[r][j]
                    self.checked += 1
                    if b == 0 or self._stamp.get(b) != (x, j, g):
                        raise OscarError(
                            f"OSCAR: the window records of a request with {prefix[r]} computed tokens were "
                            "freed and reused before it restored from them (its window slot was lost on "
                            "vLLM's V1 model runner, or a hit was accepted without its records); serve with "
                            'additional_config {"oscar": {"window_records": "held"}} or the V2 model runner '
                            "(docs/vllm.md, 'Prefix caching')"
                        )
        for r in range(len(prefix)):
            p, s = prefix[r], seq[r]
            if s <= p:
                continue
            for i in range(p // ib, (s - 1) // ib + 1):  # INT2 pages written: no longer records
                self._drop(int2_tables[r][i])
            for j in range(p // wb, (s - 1) // wb + 1):
                x = int2_tables[r][(j * wb) // ib]
                for g, tables in enumerate(window_tables):
                    b = tables[r][j]
                    if b == 0:
                        continue
                    old = self._where.get((x, j, g))
                    if old is not None and old != b:
                        self._drop(old)  # X was reused by another prefix
                    self._drop(b)
                    self._stamp[b] = (x, j, g)
                    self._where[(x, j, g)] = b
