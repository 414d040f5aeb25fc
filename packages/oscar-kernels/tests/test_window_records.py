"""The window-record write (Triton) against its torch reference, and the reference against the
record layout read back row by row: random rows and pages (never zeros), a head size that is not
a power of two, records that span several pages, sink parts cut at ``sink``, padding tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, compile_check_ptx, needs_triton

from oscar_kernels import write_window_records
from oscar_kernels.window_records import write_window_records_ref

H, D, SLOTS = 2, 48, 5


def _case(sink: int, ring: int, wb: int, part: int, parts: int, rpp: int, seed: int, pad: int = 2):
    gen = torch.Generator().manual_seed(seed)
    # three rows: a prefill chunk across window blocks, a decode, a chunk at the sink's edge
    rows_tok = [(0, 0, 11), (1, 37, 1), (2, sink - 1 if sink else 3, 6)]
    seq_index = torch.cat([torch.full((n,), b) for b, _, n in rows_tok]).int()
    positions = torch.cat([torch.arange(p, p + n) for _, p, n in rows_tok]).int()
    t = seq_index.shape[0]
    slot_mapping = torch.randint(0, 100, (t + 2,), generator=gen)
    slot_mapping[4] = -1  # a padding token inside the batch writes nothing
    # CUDA-graph padding (``pad`` tokens; without it the step's last token is a live one)
    slot_mapping = slot_mapping[: t + pad]
    seq_index = torch.cat([seq_index, torch.full((pad,), 2, dtype=torch.int32)])
    positions = torch.cat([positions, torch.zeros(pad, dtype=torch.int32)])
    slot_mapping[t:] = -1
    rec = 2 * H * (wb + part)
    g = -(-rec // rpp)
    width = 48 // wb + 1
    pages = (
        torch.randperm(g * 3 * width + 1, generator=gen)[1:].reshape(g, 3, width) + 0
    )  # distinct, no page 0
    store = torch.randn(pages.max() + 1, rpp, D, generator=gen).bfloat16()
    ring_k, ring_v = (torch.randn(SLOTS, H, ring, D, generator=gen).bfloat16() for _ in range(2))
    sink_k, sink_v = (torch.randn(SLOTS, H, sink, D, generator=gen).bfloat16() for _ in range(2))
    ws = torch.tensor([3, 0, 4], dtype=torch.int32)
    ring_rows = torch.tensor([1, 0, 2], dtype=torch.int32)
    dev = [x.to(DEVICE) for x in (store, pages.int(), slot_mapping, seq_index, positions, ws, ring_k, ring_v,
                                   ring_rows, sink_k, sink_v)]  # fmt: skip
    return dev, (wb, part, parts), rows_tok


def _call(fn, dev, geo, sink_in_ring, **kw):
    store, pages, sm, si, pos, ws, rk, rv, rr, sk, sv = dev
    out = store.clone()
    fn(out, pages, *geo, sm, si, pos, ws, rk, rv, rr, sk, sv, sink_in_ring, **kw)
    return out


GEOMETRIES = [
    # sink, ring, window block, sink part, parts, rows per page
    (5, 16, 8, 3, 2, 20),  # the second part is cut at sink (rows 3..5 of 6)
    (4, 7, 4, 4, 1, 13),  # a ring that is not a power of two, pages of odd rows
    (0, 8, 8, 0, 1, 32),  # no sink
]


@needs_triton
@pytest.mark.parametrize("geo", GEOMETRIES)
@pytest.mark.parametrize(("sink_in_ring", "pad"), [(True, 2), (False, 2), (True, 0)])
def test_triton_write_equals_the_reference_bitwise(geo, sink_in_ring, pad):
    """Bitwise: every token's ring row, and each (row, block)'s sink part (the kernel writes it
    from the last token of the row's run in the block only: the step's last token included,
    ``pad = 0``)."""
    sink, ring, wb, part, parts, rpp = geo
    dev, g, _ = _case(sink, ring, wb, part, parts, rpp, seed=sum(geo), pad=pad)
    ref = _call(write_window_records_ref, dev, g, sink_in_ring)
    out = _call(write_window_records, dev, g, sink_in_ring, backend="triton")
    assert not torch.equal(ref, dev[0]), "the reference wrote nothing"
    assert torch.equal(out, ref)


@pytest.mark.parametrize("geo", GEOMETRIES[:2])
def test_the_reference_stores_each_row_where_the_record_layout_says(geo):
    """Read every live token's ring row and sink-part rows back through the layout rule."""
    sink, ring, wb, part, parts, rpp = geo
    dev, g, rows_tok = _case(sink, ring, wb, part, parts, rpp, seed=7)
    store, pages, sm, si, pos, ws, rk, rv, rr, sk, sv = (x.cpu() for x in dev)
    out = _call(write_window_records_ref, dev, g, True).cpu()
    untouched = torch.ones(out.shape[:2], dtype=torch.bool)
    for t in range(si.shape[0]):
        b, p = int(si[t]), int(pos[t])
        blk = p // wb
        for kv, (ring_src, sink_src) in enumerate(((rk, sk), (rv, sv))):
            for h in range(H):
                r = (kv * H + h) * wb + p % wb
                page = int(pages[r // rpp, b, blk])
                want = sink_src[ws[b], h, p] if p < sink else ring_src[rr[b], h, p % ring]
                if sm[t] < 0:
                    continue
                assert torch.equal(out[page, r % rpp], want), (t, kv, h)
                untouched[page, r % rpp] = False
                for j in range(part):
                    s = (blk % parts) * part + j
                    rs = 2 * H * wb + (kv * H + h) * part + j
                    pg = int(pages[rs // rpp, b, blk])
                    if s < sink:
                        assert torch.equal(out[pg, rs % rpp], sink_src[ws[b], h, s]), (t, kv, h, j)
                        untouched[pg, rs % rpp] = False
    # nothing else changed (padding tokens, sink rows past ``sink``)
    assert torch.equal(out[untouched], store[untouched])


@needs_triton
def test_a_transposed_table_view_is_read_as_its_values():
    sink, ring, wb, part, parts, rpp = GEOMETRIES[0]
    dev, g, _ = _case(sink, ring, wb, part, parts, rpp, seed=3)
    pages = dev[1]
    view = pages.transpose(1, 2).contiguous().transpose(1, 2)  # same values, last stride != 1
    assert view.stride(-1) != 1
    ref = _call(write_window_records_ref, dev, g, True)
    out = _call(write_window_records, [dev[0], view, *dev[2:]], g, True, backend="triton")
    assert torch.equal(out, ref)


@needs_triton
def test_window_records_kernel_compiles_for_sm90():
    ptx = compile_check_ptx("cc.compile_window_records(90)")
    assert "st.global" in ptx
    # the record geometry is compile-time: no emulated 64-bit division (57 of them when it was not)
    assert "div.s64" not in ptx and "rem.s64" not in ptx
