"""The step plan: what one engine step's layers share, built once per step from the engine's batch.

:func:`plan_step` turns an engine's per-step tensors (query offsets, lengths, block table, slot
mapping, window slots) into a :class:`StepPlan`; :class:`StepBuffers` keeps plans at fixed
addresses for CUDA graphs; :func:`step_record` is a plan's host summary (logs, tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from oscar_math.errors import OscarError

from .slots import WindowSlots

if TYPE_CHECKING:
    from .record_stamps import RecordStamps

__all__ = ["StepPlan", "plan_step", "StepBuffers", "step_record", "to_device"]


@dataclass
class StepPlan:
    """One engine step, shared by every layer: the batch (int32 on the model's device), which window
    slots to restore or capture, and the launch plans the step's first layer makes for the rest
    (:func:`oscar_kernels.serving.run_layer`). Built by :func:`plan_step` from an engine's batch."""

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
    #: the restores' device index by window geometry, built by the step's first layer of each
    #: geometry and read by the others (:func:`oscar_kernels.serving.restore_window_rows`)
    restore_index: dict = field(default_factory=dict)
    #: transient window records: the builder's stamps and this step's number (checked once per
    #: step by the first layer, :class:`RecordStamps`)
    stamps: RecordStamps | None = None
    step_no: int = 0
    #: set by the first layer that checked the step's index tensors against its cache: every layer
    #: of a step shares them, so the others skip the checks (each is a host synchronisation)
    bounds_checked: list[bool] = field(default_factory=lambda: [False])
    #: the layers (ids) whose windows the metadata builders already restored for this step
    restored_by: set[int] = field(default_factory=set)
    #: per row on the host: query tokens (exact) and an upper bound of ``seq_lens`` (vLLM's V2
    #: runner gives bounds): they size a dense prefill's packed keys without a synchronisation
    query_lens_host: tuple[int, ...] = ()
    seq_lens_bound_host: tuple[int, ...] = ()
    #: window operations every layer runs: ``before`` its write (a window slot restored from a
    #: snapshot or rebuilt from INT2 pages) and ``after_attend``, before the ring write (a snapshot
    #: captured); :class:`oscar_kernels.serving.WindowOp`
    before: tuple = ()
    after_attend: tuple = ()
    #: launch plans of this step by layer configuration: made by the first layer of each
    #: configuration, reused by the others (:func:`oscar_kernels.serving.run_layer`)
    launches: dict = field(default_factory=dict)
    #: second streams with a layer's INT2 rows not yet joined (serving.run_layer, join_layer), and
    #: the step tensors those passes read, held until the join frees them
    side: list = field(default_factory=list)
    keep: list = field(default_factory=list)
    #: the engine's name of the step's last layer: a pass left open by a layer's ``defer_join``
    #: is joined by the next layer's :func:`~oscar_kernels.serving.run_layer`, and the last one's
    #: by the engine there (``""``: unknown, every layer joins its own)
    last_layer: str = ""


def to_device(host: torch.Tensor, dev: torch.device, async_copy: bool) -> torch.Tensor:
    """``host`` on ``dev``; with ``async_copy`` without waiting for the stream: a blocking copy from
    pageable memory ends in a stream synchronisation, which makes the step's metadata build wait for
    the previous step's kernels. Pinned memory and ``non_blocking`` (the host allocator keeps the
    buffer until the copy has run)."""
    if not async_copy or dev.type != "cuda" or host.device.type != "cpu":
        return host.to(dev)
    return host.pin_memory().to(dev, non_blocking=True)


def plan_step(
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
) -> StepPlan:
    """:class:`StepPlan` from an engine's per-step tensors (vLLM's ``CommonAttentionMetadata``
    fields; SGLang's ``ForwardBatch`` gives the same).

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
        ws = to_device(window_slots[:b].to(torch.int32), dev, async_copy)
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
    return StepPlan(
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
    """Persistent device tensors that every step's :class:`StepPlan` lives in.

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

    def hold(self, md: StepPlan) -> StepPlan:
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


def step_record(md: StepPlan) -> dict:
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
