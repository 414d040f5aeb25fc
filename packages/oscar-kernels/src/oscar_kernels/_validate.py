"""Input checks shared by the ops (messages name the argument).

Two kinds: shape/dtype/device checks (host metadata only, always on) and *bounds*
checks on the index tensors' values — page ids, window slots, INT2 slots. A Triton
kernel given an out-of-range id reads or writes outside its tensor without any error,
so the ops check the ids they will dereference before launching. The bounds checks are
vectorised (a few elementwise ops over ``[B, max_pages]`` and ``[N]``) and end in one
device-to-host copy, i.e. one synchronisation per call. They switch themselves off
while a CUDA graph is being captured and while ``torch.compile`` traces (both forbid
that synchronisation); :func:`set_bounds_checks` switches them off for the process
(an engine that has validated its own tables), and ``paged_write`` /
``extend_attention`` also take ``check_bounds=False`` per call.
"""

from __future__ import annotations

import torch

from oscar_math import OscarError, check

from .layout import PagedKVCache

__all__ = [
    "check_index_tensor",
    "check_queries",
    "set_bounds_checks",
    "bounds_checks_enabled",
    "check_decode_bounds",
    "check_extend_bounds",
    "check_write_bounds",
]

_BOUNDS_CHECKS = {"enabled": True}


def set_bounds_checks(enabled: bool) -> bool:
    """Turn the ops' bounds checks on or off for this process; returns the previous setting."""
    check(isinstance(enabled, bool), "enabled", "a bool", type(enabled))
    prev = _BOUNDS_CHECKS["enabled"]
    _BOUNDS_CHECKS["enabled"] = enabled
    return prev


def bounds_checks_enabled(check_bounds: bool | None = None) -> bool:
    """Whether a call runs its bounds checks: the per-call flag (``None`` = the process
    setting), never while capturing a CUDA graph or tracing with ``torch.compile``."""
    on = _BOUNDS_CHECKS["enabled"] if check_bounds is None else check_bounds
    if not on:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return False
    return not torch.compiler.is_compiling()


def check_index_tensor(name: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    check(isinstance(t, torch.Tensor), name, "a torch.Tensor", type(t))
    check(tuple(t.shape) == tuple(shape), f"shape of {name}", list(shape), tuple(t.shape))
    check(t.dtype in (torch.int32, torch.int64), f"dtype of {name}", "torch.int32 or torch.int64", t.dtype)
    check(t.device == device, f"device of {name}", device, t.device)


def check_queries(name: str, q: torch.Tensor, cache: PagedKVCache, ndim: int) -> int:
    """Validate ``[..., H_q, d]`` queries; returns the GQA group size."""
    lo = cache.layout
    check(q.dim() == ndim, f"rank of {name}", ndim, q.dim())
    check(q.shape[-1] == lo.head_dim, f"head dim of {name}", lo.head_dim, q.shape[-1])
    hq = q.shape[-2]
    check(hq % lo.num_kv_heads == 0, f"heads of {name}", f"a multiple of num_kv_heads {lo.num_kv_heads}", hq)
    check(
        q.dtype in (torch.bfloat16, torch.float16, torch.float32),
        f"dtype of {name}",
        "bf16, fp16 or fp32",
        q.dtype,
    )
    check(q.device == cache.device, f"device of {name}", cache.device, q.device)
    return hq // lo.num_kv_heads


def _raise_first(failures: list[tuple[str, str, torch.Tensor, torch.Tensor]]) -> None:
    """``failures``: ``(name, expected, bad_mask, values)``; one host sync for all masks."""
    if not failures:
        return
    flags = torch.stack([bad.any() for _, _, bad, _ in failures]).tolist()  # the one sync
    for (name, expected, bad, values), hit in zip(failures, flags, strict=True):
        if hit:
            idx = tuple(int(i) for i in bad.nonzero()[0])
            where = idx[0] if len(idx) == 1 else list(idx)
            raise OscarError(f"Invalid {name}: expected {expected}, got {int(values[idx])} at index {where}")


def _page_failures(cache: PagedKVCache, block_table: torch.Tensor, lengths: torch.Tensor, lengths_name: str):
    """Every page that holds one of the first ``lengths[b]`` tokens must be a real page."""
    ps, n_pages = cache.layout.page_size, cache.num_pages
    max_pages = block_table.shape[1]
    lengths = lengths.long()
    used = torch.arange(max_pages, device=block_table.device)[None, :] < ((lengths + ps - 1) // ps)[:, None]
    bt = block_table.long()
    return [
        (lengths_name, f"in [0, block_table.shape[1] * page_size = {max_pages * ps}]",
         (lengths < 0) | (lengths > max_pages * ps), lengths),
        ("block_table", f"page ids in [0, num_pages = {n_pages}) for every page a sequence uses",
         used & ((bt < 0) | (bt >= n_pages)), bt),
    ]  # fmt: skip


def _slot_failure(cache: PagedKVCache, window_slots: torch.Tensor, active: torch.Tensor):
    ws = window_slots.long()
    m = cache.max_seqs
    return ("window_slots", f"rows in [0, max_seqs = {m}) for every non-empty sequence",
            active & ((ws < 0) | (ws >= m)), ws)  # fmt: skip


def check_decode_bounds(
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
    check_bounds: bool | None = None,
) -> None:
    """Bounds of decode's index tensors (shapes already checked)."""
    if not bounds_checks_enabled(check_bounds):
        return
    failures = _page_failures(cache, block_table, seq_lens, "seq_lens")
    failures.append(_slot_failure(cache, window_slots, seq_lens > 0))
    _raise_first(failures)


def check_extend_bounds(
    cache: PagedKVCache,
    num_tokens: int,
    max_query_len: int,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor,
    window_slots: torch.Tensor,
    check_bounds: bool | None = None,
) -> None:
    """Bounds of extend's index tensors: chunk offsets inside ``q``, prefix + chunk pages, window rows."""
    if not bounds_checks_enabled(check_bounds):
        return
    cu = cu_seqlens_q.long()
    chunk = cu[1:] - cu[:-1]
    bad_cu = torch.zeros_like(cu, dtype=torch.bool)
    bad_cu[0] = cu[0] != 0
    bad_cu[1:] = (chunk < 0) | (chunk > max_query_len) | (cu[1:] > num_tokens)
    # the chunk's own INT2 rows and sink rows are read too (written before the call)
    total = prefix_lens.long() + chunk.clamp_min(0)
    failures = _page_failures(cache, block_table, total, "prefix_lens + chunk length")
    failures += [
        ("cu_seqlens_q", f"offsets from 0, non-decreasing by at most max_query_len = {max_query_len}, "
         f"up to T = {num_tokens}", bad_cu, cu),
        _slot_failure(cache, window_slots, total > 0),
    ]  # fmt: skip
    _raise_first(failures)


def check_write_bounds(
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    seq_index: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
    check_bounds: bool | None = None,
) -> None:
    """Bounds of the write's index tensors, for the tokens that are written (``slot >= 0``)."""
    if not bounds_checks_enabled(check_bounds):
        return
    lo = cache.layout
    n_slots = cache.num_pages * lo.page_size
    slot = slot_mapping.long()
    valid = slot >= 0
    b = seq_lens.shape[0]
    sidx = seq_index.long()
    sidx_ok = (sidx >= 0) & (sidx < b)
    safe = torch.where(sidx_ok, sidx, 0)
    pos = positions.long()
    lens = seq_lens.long()[safe] if b > 0 else torch.zeros_like(pos)
    failures = [
        ("slot_mapping", f"slots < num_pages * page_size = {n_slots} (negative = padding)",
         slot >= n_slots, slot),
        ("seq_index", f"sequence indices in [0, {b}) for every written token", valid & ~sidx_ok, sidx),
        ("positions", "0 <= position < seq_lens[seq_index] for every written token",
         valid & sidx_ok & ((pos < 0) | (pos >= lens)), pos),
    ]  # fmt: skip
    if lo.window_tokens > 0 and b > 0:
        ws = window_slots.long()[safe]
        failures.append(
            (
                "window_slots",
                f"rows in [0, max_seqs = {cache.max_seqs}) for every written sequence",
                valid & sidx_ok & ((ws < 0) | (ws >= cache.max_seqs)),
                ws,
            )  # fmt: skip
        )
    _raise_first(failures)
