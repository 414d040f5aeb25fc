"""Out-of-range ids raise OscarError before any kernel runs (a GPU kernel would not notice)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, fill_cache

from oscar_kernels import CacheLayout, decode_attention, extend_attention, paged_write, set_bounds_checks
from oscar_kernels._validate import bounds_checks_enabled, check_decode_bounds
from oscar_math import OscarError

LO = CacheLayout(2, 32, page_size=4, sink_tokens=2, recent_tokens=3)
LENS = [6, 13]


@pytest.fixture
def filled():
    gen = torch.Generator().manual_seed(0)
    cache, params, bt, ws, keys, values = fill_cache(LO, LENS, gen)
    return cache, params, bt, ws, keys, values


def _decode(cache, params, bt, ws, sl=None):
    q = torch.randn(2, 4, 32, device=DEVICE)
    sl = torch.tensor(LENS, dtype=torch.int32, device=DEVICE) if sl is None else sl
    return decode_attention(q, cache, params, bt, sl, ws, backend="torch")


def test_decode_rejects_bad_page_ids_and_window_rows(filled):
    cache, params, bt, ws, _, _ = filled
    _decode(cache, params, bt, ws)  # valid
    for bad in (cache.num_pages, -1):
        b2 = bt.clone()
        b2[1, 3] = bad  # page 3 holds tokens 12.. of the 13-token sequence
        with pytest.raises(OscarError, match=rf"Invalid block_table: .* got {bad} at index \[1, 3\]"):
            _decode(cache, params, b2, ws)
    b2 = bt.clone()
    b2[0, 2:] = -1  # entries past a sequence's last page are padding: not checked
    _decode(cache, params, b2, ws)
    w2 = ws.clone()
    w2[0] = cache.max_seqs
    with pytest.raises(OscarError, match="Invalid window_slots"):
        _decode(cache, params, bt, w2)
    too_long = torch.tensor([6, bt.shape[1] * 4 + 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(OscarError, match="Invalid seq_lens"):
        _decode(cache, params, bt, ws, too_long)


def test_extend_rejects_bad_ids(filled):
    cache, params, bt, ws, _, _ = filled
    q = torch.randn(5, 4, 32, device=DEVICE)
    k = torch.randn(5, 2, 32, device=DEVICE)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    prefix = torch.tensor([4, 10], dtype=torch.int32, device=DEVICE)

    def run(cu=cu, prefix=prefix, bt=bt, ws=ws, **kw):
        return extend_attention(q, k, k, cache, params, cu, prefix, bt, ws, 3, backend="torch", **kw)

    run()
    b2 = bt.clone()
    b2[1, 2] = cache.num_pages + 7
    with pytest.raises(OscarError, match="Invalid block_table"):
        run(bt=b2)
    with pytest.raises(OscarError, match="Invalid cu_seqlens_q"):
        run(cu=torch.tensor([0, 2, 6], dtype=torch.int32, device=DEVICE))  # past T = 5
    with pytest.raises(OscarError, match="Invalid cu_seqlens_q"):
        run(cu=torch.tensor([0, 4, 5], dtype=torch.int32, device=DEVICE))  # chunk 4 > max_query_len 3
    with pytest.raises(OscarError, match="Invalid window_slots"):
        run(ws=torch.tensor([0, -2], dtype=torch.int32, device=DEVICE))
    if DEVICE.type == "cpu":  # on CUDA an out-of-range gather is a device assert that ends the process
        with pytest.raises(IndexError):  # opted out per call: the torch reference indexes out of range
            run(bt=b2, check_bounds=False)


def test_write_rejects_bad_slots_positions_and_rows(filled):
    cache, params, _, ws, _, _ = filled
    k = torch.randn(3, 2, 32, device=DEVICE)
    n_slots = cache.num_pages * LO.page_size
    seq = torch.tensor([0, 0, 1], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([6, 7, 13], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([8, 14], dtype=torch.int32, device=DEVICE)

    def run(slots, pos=pos, seq=seq, ws=ws):
        slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        paged_write(cache, params, k, k, slots, pos, seq, sl, ws, backend="torch")

    run([0, 1, -1])  # negative slot = padding, skipped
    with pytest.raises(OscarError, match=rf"Invalid slot_mapping: .* got {n_slots} at index 1"):
        run([0, n_slots, 2])
    with pytest.raises(OscarError, match="Invalid positions"):
        run([0, 1, 2], pos=torch.tensor([6, 8, 13], dtype=torch.int32, device=DEVICE))  # 8 >= seq_lens 8
    with pytest.raises(OscarError, match="Invalid seq_index"):
        run([0, 1, 2], seq=torch.tensor([0, 2, 1], dtype=torch.int32, device=DEVICE))
    with pytest.raises(OscarError, match="Invalid window_slots"):
        run([0, 1, 2], ws=torch.tensor([0, 99], dtype=torch.int32, device=DEVICE))
    # a padding token may carry any position / sequence / row: it is not written
    run([0, 1, -1], seq=torch.tensor([0, 0, 5], dtype=torch.int32, device=DEVICE))


def test_bounds_checks_switch_off_for_the_process(filled):
    cache, params, bt, ws, _, _ = filled
    b2 = bt.clone()
    b2[1, 3] = cache.num_pages
    sl = torch.tensor(LENS, dtype=torch.int32, device=DEVICE)
    assert set_bounds_checks(False) is True
    try:
        assert not bounds_checks_enabled() and bounds_checks_enabled(True)
        check_decode_bounds(cache, b2, sl, ws)  # no error: the engine vouches for its tables
    finally:
        set_bounds_checks(True)
    with pytest.raises(OscarError, match="block_table"):
        check_decode_bounds(cache, b2, sl, ws)
