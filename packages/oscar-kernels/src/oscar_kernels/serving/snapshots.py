"""Window snapshots and rebuilds: the BF16 window rows of a prefix, kept or recomputed, for
engines whose prefix cache shares KV by content (SGLang's radix tree).

* :class:`SnapshotStore` (host index) and :func:`prefix_digests`: a request's windows copied at a
  page boundary and published under the content digest of its prefix; a later hit of exactly
  that prefix copies them back (:func:`copy_windows`): a hit then equals a miss bitwise.
* :func:`rebuild_windows`: a prefix's window rows recomputed from its INT2 pages (an
  approximation: those rows are then INT2-accurate, not BF16).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from oscar_math import unpack_int2

from ..layout import PagedKVCache
from ..paged_write import paged_write
from ..params import ExpandedParams
from ..reference.attention import rope_mean_at

__all__ = [
    "SnapshotStore",
    "prefix_digests",
    "rebuild_windows",
    "copy_windows",
    "CopyWindows",
    "RebuildWindows",
    "CaptureChunk",
]


def copy_windows(cache: PagedKVCache, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy window rows ``src`` to ``dst`` (``[n]`` int64 row indices of the window pools: a
    snapshot into a request's slot or back)."""
    for t in (cache.k_sink, cache.v_sink, cache.k_recent, cache.v_recent):
        if t.shape[2]:
            t[dst] = t[src]


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


# ---- the window operations of a step (run by every layer: oscar_kernels.serving.run_layer) ----


@dataclass(frozen=True)
class CopyWindows:
    """Window rows ``src`` copied to ``dst`` in every layer (``[n]`` int64 on the cache's device):
    a snapshot restored into a request's slot before the write, or a slot captured into a
    snapshot after a decode step's write."""

    dst: torch.Tensor
    src: torch.Tensor

    def __call__(
        self, cache: PagedKVCache, params: ExpandedParams, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> None:
        copy_windows(cache, self.dst, self.src)


@dataclass(frozen=True)
class RebuildWindows:
    """Window rows of prefixes recomputed from their INT2 pages before the write (an approximate
    hit): per entry ``(block_table_row, slot, start, prefix_len)`` as :func:`rebuild_windows`."""

    rows: tuple[tuple[torch.Tensor, int, int, int], ...]

    def __call__(
        self, cache: PagedKVCache, params: ExpandedParams, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> None:
        for table_row, slot, start, prefix in self.rows:
            rebuild_windows(cache, table_row, slot, start, prefix, params=params)


@dataclass(frozen=True)
class CaptureChunk:
    """Snapshots at page boundaries inside an extend step's chunks, after attention and before the
    ring write: the slots' windows (sink rows written, ring as before the chunk) copied into the
    snapshot rows, then the chunk's tokens up to each boundary written into the snapshot's ring.

    ``src``/``dst``: ``[n]`` slots and snapshot rows; ``tokens``: ``[m]`` indices of those tokens
    in the step; ``positions``/``snapshot_index``: their positions and which snapshot (``[m]``);
    ``lengths``: ``[n]`` int32 snapshot lengths; ``slot_mapping``: ``[m]`` their INT2 slots."""

    src: torch.Tensor
    dst: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    snapshot_index: torch.Tensor
    lengths: torch.Tensor
    slot_mapping: torch.Tensor

    def __call__(
        self, cache: PagedKVCache, params: ExpandedParams, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> None:
        copy_windows(cache, self.dst, self.src)
        if k is None or v is None:
            return
        paged_write(
            cache,
            params,
            k[self.tokens].contiguous(),
            v[self.tokens].contiguous(),
            self.slot_mapping,
            self.positions,
            self.snapshot_index,
            self.lengths,
            self.dst.to(torch.int32),
            parts="ring",
        )
