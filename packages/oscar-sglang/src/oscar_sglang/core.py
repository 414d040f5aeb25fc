"""The SGLang adapter's parts that need no SGLang (plain torch + oscar-kernels).

Finding the rotations, matching them to the model and to this rank's KV heads, the memory
arithmetic and the block table. The step itself (plan, layer run, window slots, snapshots)
is the engine-neutral serving core, :mod:`oscar_kernels.serving`; the SGLang classes and hooks
that use both live in :mod:`oscar_sglang.sglang_glue`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from oscar_kernels import CacheLayout, ExpandedParams, LayerQuantParams, page_bytes
from oscar_kernels.serving import (
    SnapshotStore,
    WindowTracker,
    check_head_dim,
    kv_heads_of_rank,
    load_for_serving,
    prefix_digests,
    rank_layout,
    rebuild_windows,
    shard_params,
)
from oscar_kernels.serving import window_bytes_per_slot as _slot_bytes
from oscar_kernels.serving.fold import FoldTarget, fold_output_projections
from oscar_kernels.serving.settings import RadixCache, ServingSettings
from oscar_math.errors import OscarError

__all__ = [
    "ENV_ROTATIONS",
    "BACKEND_NAME",
    "rotations_path",
    "check_geometry",
    "kv_heads_of_rank",
    "RankQuant",
    "load_rank_quant",
    "int2_bytes_per_token",
    "window_bytes_per_slot",
    "tokens_after_windows",
    "block_table",
    "WindowTracker",
    "rebuild_windows",
    "ENV_RADIX",
    "ENV_SNAPSHOTS",
    "RADIX_MODES",
    "radix_mode",
    "snapshot_count",
    "prefix_digests",
    "SnapshotStore",
    "fold_outputs",
    "overlap_write",
]

#: environment variable that carries the artifact path to every SGLang process
ENV_ROTATIONS = "OSCAR_ROTATIONS"
#: the name of the attention backend (``--attention-backend oscar``)
BACKEND_NAME = "oscar"
#: what the radix (prefix) cache does under OSCAR (``--oscar-radix-cache``), see :func:`radix_mode`
ENV_RADIX = "OSCAR_SGLANG_RADIX_CACHE"
#: window snapshots kept for exact radix hits (``--oscar-window-snapshots``)
ENV_SNAPSHOTS = "OSCAR_SGLANG_WINDOW_SNAPSHOTS"
RADIX_MODES = tuple(m.value for m in RadixCache)  # radix_mode(): exact is the default


def _settings() -> ServingSettings:
    """OSCAR's options in this SGLang process: the launcher copies the ``--oscar-*`` arguments into
    the environment its scheduler subprocesses inherit (the one way across SGLang's process
    boundary); every process parses them here, through the engines' one settings object."""
    return ServingSettings.parse(None, os.environ, "OSCAR settings", require_rotations=False)


def radix_mode() -> str:
    """The radix-cache policy under ``--attention-backend oscar`` (``--oscar-radix-cache``).

    * ``exact`` (default): hits are cut back to the longest page-aligned prefix whose BF16 window
      rows were kept (a window snapshot), which are copied into the request: a hit reads exactly
      the rows a miss computes for itself (bitwise on CPU; on a GPU up to what SGLang's own BF16
      radix cache allows: K/V computed in another batch may differ in the last bits);
    * ``off``: SGLang's radix cache is built disabled, so there are no hits;
    * ``int2``: any hit; the prefix's window rows are rebuilt from its INT2 pages
      (approximate: those tokens are read at INT2 where a miss reads BF16).
    """
    return _settings().radix_cache.value


def prefill_options() -> tuple[bool, bool]:
    """``(dense_prefill, split_extend)``: long prefill chunks through a checked dense FlashAttention
    kernel (``$OSCAR_DENSE_PREFILL``, on by default), and short chunks over long prefixes split over
    more programs (``$OSCAR_VLLM_SPLIT_EXTEND``, the one switch both engines share; on by default)."""
    s = _settings()
    return s.dense_prefill, s.split_extend


def overlap_write() -> bool:
    """Whether a decode step writes its INT2 rows beside its attention (``$OSCAR_OVERLAP_WRITE``,
    on by default; :func:`oscar_kernels.serving.run_layer`'s ``overlap_write``)."""
    return _settings().overlap_write


def _fold_targets(model: torch.nn.Module, params: dict[int, ExpandedParams]) -> Iterator[FoldTarget]:
    """SGLang's attention modules whose ``attn`` (a ``RadixAttention``) is a layer of ``params``."""
    for name, module in model.named_modules():
        attn = getattr(module, "attn", None)
        lid = getattr(attn, "layer_id", None)
        if lid not in params:
            continue

        def serve(on: bool, lid: int = lid) -> None:
            if params[lid].rotated_output != on:
                params[lid] = replace(params[lid], rotated_output=on)

        yield FoldTarget(
            name, module, int(attn.tp_q_head_num), int(attn.head_dim),
            lambda lid=lid: params[lid].v_rotation, params[lid].rotated_output, serve,
        )  # fmt: skip


def fold_outputs(model: Any, params: dict[int, ExpandedParams], logger: Any = None) -> int:
    """``R_V`` into the output projections of ``model``'s OSCAR layers where exact
    (:mod:`oscar_kernels.serving.fold`; ``fold_output``, on by default, ``$OSCAR_FOLD_OUTPUT``):
    those layers' ``params`` then return rotated outputs. Run when the backend is built (the model
    is loaded, nothing captured yet). Returns the number of layers folded."""
    if model is None:
        return 0
    return fold_output_projections(_fold_targets(model, params), _settings().fold_output, logger)


def snapshot_count(mode: str, request_slots: int) -> int:
    """Window snapshot rows to allocate: 0 unless ``mode == "exact"``; default two per request slot
    (``--oscar-window-snapshots`` sets the count).

    Each request slot may hold up to three not-yet-published snapshots (see
    :class:`SnapshotStore`), rarely more than two at once; the rest hold published prefixes,
    evicted least recently used first.
    """
    if mode != "exact":
        return 0
    n = _settings().window_snapshots
    return 2 * request_slots if n is None else n


def rotations_path() -> str:
    """The artifact path given by ``--oscar-rotations`` / ``$OSCAR_ROTATIONS``."""
    path = _settings().rotations
    if not path:
        raise OscarError(
            f"--attention-backend {BACKEND_NAME} needs a rotations artifact: pass --oscar-rotations FILE "
            f"or set {ENV_ROTATIONS}=FILE (written by 'oscar calibrate')"
        )
    return path


@dataclass(frozen=True)
class RankQuant:
    """What one rank needs: its cache layout and per-layer params for its KV heads.

    Attributes:
        layout: one layer's cache sizes (``num_kv_heads`` = this rank's heads).
        params: ``layer_id -> ExpandedParams`` (global layer ids) on the cache device.
        heads: the global KV-head indices of this rank.
        path: the artifact file.
    """

    layout: CacheLayout
    params: dict[int, ExpandedParams]
    heads: list[int]
    path: str


def check_geometry(head_dim: int, v_head_dim: int | None, on_gpu: bool = False) -> None:
    """Reject attention shapes the kernels do not serve (one line, at start-up)."""
    try:
        check_head_dim(head_dim, v_head_dim, on_gpu=on_gpu)
    except OscarError as e:
        raise OscarError(f"--attention-backend {BACKEND_NAME}: {e}") from None


def load_rank_quant(
    path: str,
    *,
    num_layers: int,
    total_kv_heads: int,
    head_dim: int,
    v_head_dim: int | None,
    page_size: int,
    tp_size: int = 1,
    tp_rank: int = 0,
    layer_ids: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> RankQuant:
    """Load, validate and shard the artifact for one rank.

    Raises :class:`OscarError` with one line for a missing / corrupt file, a file calibrated
    for another geometry (layers, KV heads, head dim) or an unsupported head dim.
    """
    check_geometry(head_dim, v_head_dim, on_gpu=torch.device(device).type == "cuda")
    rot = load_for_serving(str(path), num_layers, total_kv_heads, head_dim)
    heads = kv_heads_of_rank(total_kv_heads, tp_size, tp_rank)
    layout = rank_layout(rot, len(heads), head_dim, page_size)
    params: dict[int, ExpandedParams] = {}
    for i in range(num_layers) if layer_ids is None else layer_ids:
        # each rank keeps the parameters of the KV heads it holds (one field table for every engine)
        lq = shard_params(LayerQuantParams.from_rotations(rot, i), heads)
        params[i] = lq.expand(len(heads), head_dim, torch.device(device))
    return RankQuant(layout, params, heads, str(path))


def int2_bytes_per_token(layout: CacheLayout, num_layers: int) -> int:
    """Pool bytes per token over ``num_layers`` layers (INT2 codes + bf16 scale/zero), rounded up."""
    return math.ceil(num_layers * page_bytes(layout) / layout.page_size)


def window_bytes_per_slot(layout: CacheLayout, num_layers: int) -> int:
    """BF16 sink + recent rows of K and V for one request slot over ``num_layers`` layers."""
    return _slot_bytes(
        num_layers, layout.num_kv_heads, layout.head_dim, layout.sink_tokens, layout.recent_tokens
    )


def tokens_after_windows(
    max_tokens: int, max_running_requests: int, layout: CacheLayout, num_layers: int, snapshots: int = 0
) -> int:
    """Token capacity left once the window rows of every request slot are paid for.

    SGLang sizes ``req_to_token_pool`` with ``max_running_requests + 1`` rows (row 0 is
    padding); each row owns one set of windows, and each of the ``snapshots`` window
    snapshots (exact radix hits) is one more set. Their bytes come out of the same budget
    that sized ``max_tokens`` INT2 tokens. Rounded down to whole pages.
    """
    cell = int2_bytes_per_token(layout, num_layers)
    windows = window_bytes_per_slot(layout, num_layers) * (max_running_requests + 1 + snapshots)
    left = max_tokens - math.ceil(windows / cell)
    return max(0, left // layout.page_size * layout.page_size)


def block_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[B, max_pages]`` int32 page ids of each request, from SGLang's ``req_to_token``.

    The paged allocator keeps a request's tokens page-aligned, so token ``i`` lives in
    page ``req_to_token[row, i // P * P] // P``. Tensor ops only (no host sync); the
    width is fixed by ``max_context_len``.
    """
    rows = req_to_token[req_pool_indices.long()]
    return (rows[:, ::page_size] // page_size).to(torch.int32)
