"""Engine-independent parts of the SGLang integration (plain torch + oscar-kernels).

Everything here can be tested without SGLang: finding the rotations, matching them to
the model and to this rank's KV heads, the memory arithmetic, the block table, and the
per-slot bookkeeping that keeps the BF16 windows correct on radix-cache hits. The
SGLang classes and hooks that use it live in :mod:`oscar_sglang.sglang_glue`.
"""

from __future__ import annotations

import hashlib
import math
import os
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from oscar_kernels import CacheLayout, ExpandedParams, LayerQuantParams, PagedKVCache, page_bytes
from oscar_kernels.reference.attention import rope_mean_at
from oscar_kernels.serving import (
    check_head_dim,
    kv_heads_of_rank,
    load_for_serving,
    rank_layout,
    shard_params,
)
from oscar_kernels.serving import window_bytes_per_slot as _slot_bytes
from oscar_math import unpack_int2
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
]

#: environment variable that carries the artifact path to every SGLang process
ENV_ROTATIONS = "OSCAR_ROTATIONS"
#: the name of the attention backend (``--attention-backend oscar``)
BACKEND_NAME = "oscar"
#: what the radix (prefix) cache does under OSCAR (``--oscar-radix-cache``), see :func:`radix_mode`
ENV_RADIX = "OSCAR_SGLANG_RADIX_CACHE"
#: window snapshots kept for exact radix hits (``--oscar-window-snapshots``)
ENV_SNAPSHOTS = "OSCAR_SGLANG_WINDOW_SNAPSHOTS"
RADIX_MODES = ("off", "exact", "int2")  # radix_mode(): exact is the default


def radix_mode() -> str:
    """The radix-cache policy under ``--attention-backend oscar`` (``$OSCAR_SGLANG_RADIX_CACHE``).

    * ``exact`` (default): hits are cut back to the longest page-aligned prefix whose BF16 window
      rows were kept (a window snapshot), which are copied into the request: a hit reads exactly
      the rows a miss computes for itself (bitwise on CPU; on a GPU up to what SGLang's own BF16
      radix cache allows: K/V computed in another batch may differ in the last bits);
    * ``off``: SGLang's radix cache is built disabled, so there are no hits;
    * ``int2``: any hit; the prefix's window rows are rebuilt from its INT2 pages
      (approximate: those tokens are read at INT2 where a miss reads BF16).
    """
    mode = os.environ.get(ENV_RADIX, "").strip().lower() or "exact"
    if mode not in RADIX_MODES:
        raise OscarError(
            f"Invalid {ENV_RADIX} / --oscar-radix-cache: expected one of {', '.join(RADIX_MODES)}, "
            f"got {mode!r}"
        )
    return mode


def snapshot_count(mode: str, request_slots: int) -> int:
    """Window snapshot rows to allocate: 0 unless ``mode == "exact"``; default two per request slot.

    Each request slot may hold up to three not-yet-published snapshots (see
    :class:`SnapshotStore`), rarely more than two at once; the rest hold published prefixes,
    evicted least recently used first.
    """
    if mode != "exact":
        return 0
    raw = os.environ.get(ENV_SNAPSHOTS, "").strip()
    if not raw:
        return 2 * request_slots
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 1:
        raise OscarError(
            f"Invalid {ENV_SNAPSHOTS} / --oscar-window-snapshots: expected an integer >= 1, got {raw!r}"
        )
    return n


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
    params: ExpandedParams | None = None,
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
    values where a miss reads BF16 (see docs/sglang.md). ``params``: the layer's parameters;
    required when they carry a pre-RoPE key mean (format version 3), whose ``RoPE_j(m) @ R_K``
    is part of an INT2 key row's value.
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
    if params is not None and params.rope_pairs:
        k = k + rope_mean_at(params, j)  # the term the write took out of INT2 key rows
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


# --------------------------------------------------------------------------- exact radix hits


def prefix_digests(
    token_ids: Sequence[int], extra_key: object, cache_salt: object, page_size: int, upto: int
) -> list[bytes]:
    """Content digests of the prefixes ``token_ids[:m]`` for ``m = page_size, 2·page_size, …, <= upto``.

    The identity SGLang's radix tree uses for KV (token ids in the namespace of
    ``extra_key`` / ``cache_salt``): equal digests mean equal K/V, so the BF16 window rows
    of a prefix can be found by content, whatever token slots now hold its pages.
    """
    h = hashlib.blake2b(repr((extra_key, cache_salt)).encode(), digest_size=16)
    ids = token_ids if isinstance(token_ids, array) and token_ids.typecode == "q" else array("q", token_ids)
    out = []
    for m in range(page_size, upto + 1, page_size):
        h.update(ids[m - page_size : m].tobytes())
        out.append(h.digest())
    return out


class SnapshotStore:
    """Host-side index of the window snapshot rows (``count`` extra window rows from ``base``).

    A *snapshot* is one window row (sink rows + ring) as a request had it at a page-aligned
    length ``K``: everything a query at position ``K`` reads in BF16 besides the INT2
    pages. The backend *captures* one when a request's write crosses a page boundary
    (tagged ``(slot, generation, K)``; at most ``keep_per_slot`` per slot: the latest page
    boundary, the one before it while an overlapped step is in flight, and a branch point
    asked for by the match); when SGLang inserts that request's first ``K`` tokens into the
    radix tree the snapshot is *published* under the content digest of those tokens. A
    later hit of exactly that prefix copies it into the new request's window row, which
    then holds what a miss would have written (bitwise).

    Buffers are recycled in this order: free, candidates of requests that left their slot
    (generation changed), published snapshots least recently used first. Never the
    buffers passed in ``busy`` (read by the current step).
    """

    def __init__(self, base: int, count: int, keep_per_slot: int = 3) -> None:
        self.base, self.count, self.keep = base, count, keep_per_slot
        self.free: list[int] = list(range(base + count - 1, base - 1, -1))
        self.cand: dict[int, tuple[int, int, int]] = {}  # buf -> (slot, generation, K)
        self.slot_cands: dict[int, list[int]] = {}  # slot -> bufs, oldest first
        self.published: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # digest -> (buf, K), LRU first
        self.buf_digest: dict[int, bytes] = {}

    def _drop_cand(self, buf: int) -> None:
        slot = self.cand.pop(buf)[0]
        self.slot_cands[slot].remove(buf)
        self.free.append(buf)

    def _alloc(self, current_gen: Sequence[int], busy: set[int]) -> int | None:
        if self.free:
            return self.free.pop()
        for buf, (slot, gen, _) in list(self.cand.items()):
            if current_gen[slot] != gen and buf not in busy:
                self._drop_cand(buf)
                return self.free.pop()
        for digest, (buf, _) in self.published.items():
            if buf not in busy:
                del self.published[digest]
                del self.buf_digest[buf]
                return buf
        return None

    def capture(
        self, slot: int, generation: int, length: int, current_gen: Sequence[int], busy: set[int]
    ) -> int | None:
        """A buffer to copy ``slot``'s windows at length ``length`` into (``None``: none free).

        ``current_gen[slot]``: the generation each request slot holds now (candidates of
        other generations are garbage).
        """
        lst = self.slot_cands.setdefault(slot, [])
        for buf in [b for b in lst if self.cand[b][1] != generation or self.cand[b][2] == length]:
            if buf not in busy:
                self._drop_cand(buf)
        while len(lst) >= self.keep and lst[0] not in busy:
            self._drop_cand(lst[0])
        buf = self._alloc(current_gen, busy)
        if buf is None:
            return None
        self.cand[buf] = (slot, generation, length)
        lst.append(buf)
        return buf

    def publish(self, slot: int, generation: int, length: int, digest: bytes) -> bool:
        """Publish the candidate of ``slot`` at ``length`` under ``digest``; False if there is none."""
        if digest in self.published:
            self.published.move_to_end(digest)
            return True
        for buf in self.slot_cands.get(slot, []):
            if self.cand[buf] == (slot, generation, length):
                del self.cand[buf]
                self.slot_cands[slot].remove(buf)
                self.published[digest] = (buf, length)
                self.buf_digest[buf] = digest
                return True
        return False

    def discard(self, buf: int) -> None:
        """Forget a candidate that was not (or not completely) written."""
        if buf in self.cand:
            self._drop_cand(buf)

    def candidates(self, slot: int, generation: int) -> list[int]:
        """Lengths of the not-yet-published snapshots of the request in ``slot``."""
        return [self.cand[b][2] for b in self.slot_cands.get(slot, []) if self.cand[b][1] == generation]

    def lookup(self, digest: bytes) -> tuple[int, int] | None:
        """``(buf, length)`` of the published snapshot of that prefix (marked recently used)."""
        hit = self.published.get(digest)
        if hit is not None:
            self.published.move_to_end(digest)
        return hit
