"""The batched window restore of a step's prefix hits (``restore_window_rows``) against the
per-row restore (``restore_windows``), bitwise: random record pages and window tables, rows whose
hits end inside the sink, just past it, and far past the ring (sink parts from held blocks), the
geometry of 64-token blocks with 16-row sink parts and a small odd one."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE

from oscar_kernels import CacheLayout, allocate_cache
from oscar_kernels.serving import WindowPages, plan_window_records, restore_window_rows, restore_windows

GEOMETRIES = [
    # KV heads, head dim, block size, sink, recent, rows per page
    (2, 32, 16, 8, 16, 20),
    (3, 16, 64, 64, 256, 288),
]


def _state(h: int, d: int, bs: int, sink: int, recent: int, rpp: int, slots: int, seed: int):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    lo = CacheLayout(h, d, page_size=bs, group_size=d, sink_tokens=sink, recent_tokens=recent)
    cache = allocate_cache(lo, 4, slots, DEVICE)
    for f in ("k_sink", "v_sink", "k_recent", "v_recent"):
        getattr(cache, f).copy_(torch.randn(getattr(cache, f).shape, generator=gen))
    plan = plan_window_records(h, bs, sink, recent, rpp, in_flight_tokens=1)
    rows = torch.randn(400, rpp, d, generator=gen).bfloat16().to(DEVICE)
    return cache, WindowPages(rows, h, plan, sink), plan, gen


@pytest.mark.parametrize("geo", GEOMETRIES)
def test_batched_restore_equals_the_per_row_restore(geo):
    h, d, bs, sink, recent, rpp = geo
    cache, pages, plan, gen = _state(h, d, bs, sink, recent, rpp, 6, sum(geo))
    wb = plan.block_size
    # hits ending inside the sink, just past it, past the ring, far past it; one row not restored
    n_cached = [max(1, sink // 2), sink + 1, sink + recent + 3, 20 * wb + 5]
    restore = [(0, 4, n_cached[0]), (2, 1, n_cached[1]), (3, 5, n_cached[2]), (1, 0, n_cached[3])]
    width = max(n_cached) // wb + 2
    tables = torch.randint(0, 400, (plan.groups, 4, width), generator=gen).int().to(DEVICE)
    want = allocate_cache(cache.layout, 4, 6, DEVICE)
    got = allocate_cache(cache.layout, 4, 6, DEVICE)
    for c in (want, got):
        for f in ("k_sink", "v_sink", "k_recent", "v_recent"):
            getattr(c, f).copy_(getattr(cache, f))
    for row, slot, n in restore:
        restore_windows(want, slot, pages, tables[:, row], n)
    memo: dict = {}
    restore_window_rows(got, pages, tables, restore, memo)
    assert len(memo) == 1
    for f in ("k_sink", "v_sink", "k_recent", "v_recent"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f
        assert not torch.equal(getattr(got, f), getattr(cache, f)), f"{f}: nothing restored"
    # a second layer of the step reuses the host index (same memo), with its own pages
    pages.rows.copy_(torch.randn(pages.rows.shape, generator=gen).bfloat16())
    for row, slot, n in restore:
        restore_windows(want, slot, pages, tables[:, row], n)
    restore_window_rows(got, pages, tables, restore, memo)
    assert len(memo) == 1
    for f in ("k_sink", "v_sink", "k_recent", "v_recent"):
        assert torch.equal(getattr(got, f), getattr(want, f)), f


def test_no_rows_restores_nothing():
    cache, pages, plan, gen = _state(2, 32, 16, 8, 16, 20, 2, 1)
    before = cache.k_sink.clone()
    restore_window_rows(cache, pages, torch.zeros(plan.groups, 1, 2, dtype=torch.int32), [])
    restore_window_rows(cache, pages, torch.zeros(plan.groups, 1, 2, dtype=torch.int32), [(0, 1, 0)])
    assert torch.equal(cache.k_sink, before)
