"""Engine-independent parts of the SGLang integration (plain torch + oscar-kernels).

Everything here can be tested without SGLang: finding the rotations, matching them to
the model and to this rank's KV heads, the memory arithmetic, the block table, and the
per-slot bookkeeping that keeps the BF16 windows correct on radix-cache hits. The
SGLang classes and hooks that use it live in :mod:`oscar_sglang.sglang_glue`.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

from oscar_kernels import CacheLayout, ExpandedParams, LayerQuantParams, PagedKVCache, page_bytes
from oscar_math import unpack_int2
from oscar_math.artifact import Rotations, load_rotations
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
]

#: environment variable that carries the artifact path to every SGLang process
ENV_ROTATIONS = "OSCAR_ROTATIONS"
#: the name of the attention backend (``--attention-backend oscar``)
BACKEND_NAME = "oscar"


def rotations_path() -> str:
    """The artifact path given by ``--oscar-rotations`` / ``$OSCAR_ROTATIONS``.

    ``--oscar-rotations`` is copied into the environment by the launcher process, so the
    scheduler subprocesses (which inherit the environment) read the same value here.
    """
    path = os.environ.get(ENV_ROTATIONS, "").strip()
    if not path:
        raise OscarError(
            f"--attention-backend {BACKEND_NAME} needs a rotations artifact: pass --oscar-rotations FILE "
            f"or set {ENV_ROTATIONS}=FILE (written by 'oscar calibrate')"
        )
    return path


def kv_heads_of_rank(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """Global KV-head indices held by attention-TP rank ``tp_rank``.

    Same split as SGLang's ``QKVParallelLinear``: with at least as many KV heads as
    ranks each rank takes a contiguous block of ``total / tp`` heads; with fewer, each
    head is replicated on ``tp / total`` consecutive ranks.
    """
    if not (0 <= tp_rank < tp_size):
        raise OscarError(f"Invalid tp_rank: expected 0 <= rank < {tp_size}, got {tp_rank}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise OscarError(
                f"Invalid tensor parallel size: {total_kv_heads} KV heads do not split over {tp_size} ranks"
            )
        n = total_kv_heads // tp_size
        return list(range(tp_rank * n, (tp_rank + 1) * n))
    if tp_size % total_kv_heads:
        raise OscarError(
            f"Invalid tensor parallel size: {tp_size} ranks do not replicate {total_kv_heads} KV heads evenly"
        )
    return [tp_rank // (tp_size // total_kv_heads)]


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


@functools.lru_cache(maxsize=4)
def _load(path: str, num_layers: int, num_kv_heads: int, head_dim: int) -> Rotations:
    return load_rotations(path, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)


def check_geometry(head_dim: int, v_head_dim: int | None) -> None:
    """Reject attention shapes the kernels do not serve (one line, at start-up)."""
    if v_head_dim is not None and v_head_dim != head_dim:
        raise OscarError(
            f"--attention-backend {BACKEND_NAME}: key head dim {head_dim} != value head dim {v_head_dim} "
            "(MLA-style attention is not supported)"
        )
    if head_dim < 16 or head_dim % 16:
        raise OscarError(
            f"--attention-backend {BACKEND_NAME}: unsupported head dim {head_dim} (the INT2 kernels need a "
            "multiple of 16)"
        )


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
    check_geometry(head_dim, v_head_dim)
    rot = _load(str(path), num_layers, total_kv_heads, head_dim)
    heads = kv_heads_of_rank(total_kv_heads, tp_size, tp_rank)
    layout = CacheLayout(
        num_kv_heads=len(heads),
        head_dim=head_dim,
        page_size=page_size,
        group_size=rot.group_size,
        sink_tokens=rot.sink_tokens,
        recent_tokens=rot.recent_tokens,
    )
    idx = torch.tensor(heads)
    params: dict[int, ExpandedParams] = {}
    for i in range(num_layers) if layer_ids is None else layer_ids:
        lq = LayerQuantParams.from_rotations(rot, i)
        if lq.granularity == "kv_head":
            # each rank keeps the rotations of the KV heads it holds (see kv_heads_of_rank)
            lq = LayerQuantParams(
                k_rotation=lq.k_rotation[idx],
                v_rotation=lq.v_rotation[idx],
                k_mean=None if lq.k_mean is None else lq.k_mean[idx],
                k_clip=torch.as_tensor(lq.k_clip).reshape(-1)[idx],
                v_clip=torch.as_tensor(lq.v_clip).reshape(-1)[idx],
            )
        params[i] = lq.expand(len(heads), head_dim, torch.device(device))
    return RankQuant(layout, params, heads, str(path))


def int2_bytes_per_token(layout: CacheLayout, num_layers: int) -> int:
    """Pool bytes per token over ``num_layers`` layers (INT2 codes + bf16 scale/zero), rounded up."""
    return math.ceil(num_layers * page_bytes(layout) / layout.page_size)


def window_bytes_per_slot(layout: CacheLayout, num_layers: int) -> int:
    """BF16 sink + recent rows of K and V for one request slot over ``num_layers`` layers."""
    return num_layers * 2 * layout.num_kv_heads * layout.window_tokens * layout.head_dim * 2


def tokens_after_windows(
    max_tokens: int, max_running_requests: int, layout: CacheLayout, num_layers: int
) -> int:
    """Token capacity left once the window rows of every request slot are paid for.

    SGLang sizes ``req_to_token_pool`` with ``max_running_requests + 1`` rows (row 0 is
    padding); each row owns one set of windows, whose bytes come out of the same budget
    that sized ``max_tokens`` INT2 tokens. Rounded down to whole pages.
    """
    cell = int2_bytes_per_token(layout, num_layers)
    windows = window_bytes_per_slot(layout, num_layers) * (max_running_requests + 1)
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


class WindowTracker:
    """Which positions of each window slot hold rows written for the request that owns it.

    SGLang's ``ReqToTokenPool.req_generation`` is bumped every time a row is handed to a
    new request. The tracker remembers, per slot, the generation it last saw and how many
    positions that request has written through this backend. A slot whose generation
    changed starts from zero, so rows left by an earlier request are never read.
    Host-side lists only: no device synchronisation.
    """

    def __init__(self, max_seqs: int) -> None:
        self.generation = [-1] * max_seqs
        self.valid = [0] * max_seqs

    def written(self, slot: int, generation: int) -> int:
        """Positions ``[0, n)`` of ``slot`` written by its current request."""
        if self.generation[slot] != generation:
            self.generation[slot] = generation
            self.valid[slot] = 0
        return self.valid[slot]

    def mark(self, slot: int, generation: int, length: int) -> None:
        self.generation[slot] = generation
        self.valid[slot] = length


def _dequant(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    c = unpack_int2(codes).to(torch.float32)  # [n, H, d]
    n, h, d = c.shape
    g = c.reshape(n, h, d // group, group) * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
    return g.reshape(n, h, d)


def rebuild_windows(
    cache: PagedKVCache,
    block_table_row: torch.Tensor,
    slot: int,
    start: int,
    prefix_len: int,
    window_end: int | None = None,
) -> None:
    """Fill slot ``slot``'s window rows for positions ``[start, prefix_len)`` from the INT2 pages.

    Used when a request's prefix came from the radix cache (written by another request,
    whose BF16 rows are gone): the sink rows ``j < sink`` and the ring rows
    ``j >= max(sink, window_end - recent)`` of those positions get the dequantised INT2
    values (rotated basis, as the ring stores them). Attention over the prefix then reads
    exactly the INT2 values of those tokens, whether through the windows or the pages.
    ``window_end`` (default ``prefix_len``): the next chunk's first query ``prefix_len``
    reads ring rows ``j > prefix_len - recent`` (windows apply per query token), and the
    chunk's own ring rows are written after its attention, so no rebuilt row is
    overwritten before it is read. This is not an exact hit: the rebuilt rows hold INT2
    values where a miss reads BF16 (see docs/sglang.md).
    """
    if window_end is None:
        window_end = prefix_len
    lo = cache.layout
    if prefix_len <= start:
        return
    s, r = lo.sink_tokens, lo.recent_tokens
    need = []
    if s > 0 and start < s:
        need.append(torch.arange(start, min(s, prefix_len)))
    if r > 0:
        r0 = max(start, s, window_end - r)
        if r0 < prefix_len:
            need.append(torch.arange(r0, prefix_len))
    if not need:
        return
    j = torch.cat(need).to(cache.device)
    page = block_table_row.long()[j // lo.page_size]
    off = j % lo.page_size
    k = _dequant(
        cache.k_codes[page, :, off], cache.k_scale[page, :, off], cache.k_zero[page, :, off], lo.group
    )
    v = _dequant(
        cache.v_codes[page, :, off], cache.v_scale[page, :, off], cache.v_zero[page, :, off], lo.group
    )
    k, v = k.to(torch.bfloat16).transpose(0, 1), v.to(torch.bfloat16).transpose(0, 1)  # [H, n, d]
    in_sink = j < s
    if bool(in_sink.any()):
        cache.k_sink[slot][:, j[in_sink]] = k[:, in_sink]
        cache.v_sink[slot][:, j[in_sink]] = v[:, in_sink]
    ring = ~in_sink
    if r > 0 and bool(ring.any()):
        rows = j[ring] % r
        cache.k_recent[slot][:, rows] = k[:, ring]
        cache.v_recent[slot][:, rows] = v[:, ring]
