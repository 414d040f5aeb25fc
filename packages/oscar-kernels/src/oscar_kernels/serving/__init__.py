"""The engine-neutral serving core: what vLLM's and SGLang's attention backends share.

An engine adapter turns its batch into a :class:`StepPlan` once per step (:func:`plan_step`),
and every layer's forward calls :func:`run_layer` with it — FlashInfer's plan/run split: the
first layer of each configuration validates and plans the launches, the others only launch.

* :mod:`.plan` — :class:`StepPlan`, :func:`plan_step`, :class:`StepBuffers` (CUDA graphs).
* :mod:`.run` — :func:`run_layer` (write → attend → ring) and its window-op hooks.
* :mod:`.slots` — which window slot each request owns and when it must be restored.
* :mod:`.window_pages` — BF16 window rows kept in engine pages (prefix-cache hits, vLLM).
* :mod:`.snapshots` — window snapshots and INT2 rebuilds (radix-cache hits, SGLang).
* :mod:`.settings` — :class:`ServingSettings`, every engine's OSCAR options, validated once.
* :mod:`.loading` — the artifact for serving: loading, sharding, layout, memory sizes.
* :mod:`.dense` — :func:`prefill_kernel`: the dense kernel prefill chunks run through.
"""

from .dense import prefill_kernel
from .loading import (
    PER_HEAD_FIELDS,
    SHARED_FIELDS,
    WINDOW_MEMORY_SHARE,
    cell_bytes,
    check_head_dim,
    default_max_seqs,
    kv_heads_of_rank,
    load_for_serving,
    rank_layout,
    shard_params,
    window_bytes_per_slot,
)
from .plan import StepBuffers, StepPlan, plan_step, step_record, to_device
from .record_stamps import RecordStamps
from .run import WindowOp, attend_step, beside, join_layer, run_layer, write_step
from .settings import RadixCache, ServingSettings, WindowRecords
from .slots import FreshRows, RequestSlots, SlotTracker, WindowSlots, WindowTracker, plan_slots
from .snapshots import (
    CaptureChunk,
    CopyWindows,
    RebuildWindows,
    SnapshotStore,
    copy_windows,
    prefix_digests,
    rebuild_windows,
)
from .window_pages import (
    WindowPages,
    WindowPlan,
    gather_columns,
    hit_window_positions,
    plan_window_records,
    restore_window_rows,
    restore_windows,
    scratch_ring,
    window_sink_parts,
    write_window_pages,
)

__all__ = [
    "prefill_kernel",
    "ServingSettings",
    "RadixCache",
    "WindowRecords",
    "StepPlan",
    "plan_step",
    "StepBuffers",
    "step_record",
    "to_device",
    "WindowOp",
    "run_layer",
    "join_layer",
    "beside",
    "write_step",
    "attend_step",
    "WindowSlots",
    "RequestSlots",
    "FreshRows",
    "SlotTracker",
    "plan_slots",
    "WindowTracker",
    "WindowPlan",
    "window_sink_parts",
    "plan_window_records",
    "WindowPages",
    "hit_window_positions",
    "gather_columns",
    "scratch_ring",
    "write_window_pages",
    "restore_window_rows",
    "restore_windows",
    "RecordStamps",
    "SnapshotStore",
    "prefix_digests",
    "rebuild_windows",
    "copy_windows",
    "CopyWindows",
    "RebuildWindows",
    "CaptureChunk",
    "load_for_serving",
    "check_head_dim",
    "kv_heads_of_rank",
    "shard_params",
    "rank_layout",
    "cell_bytes",
    "default_max_seqs",
    "window_bytes_per_slot",
    "PER_HEAD_FIELDS",
    "WINDOW_MEMORY_SHARE",
    "SHARED_FIELDS",
]
