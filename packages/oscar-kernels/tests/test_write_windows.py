"""What the write leaves in the cache, checked against the layout rule from raw keys/values.

The expected cache is built here from ``oscar_math`` (rotation by the test's own
matrices, ``quantize_int2``), not from kernel code: every token's INT2 slot, the sink
rows ``p < sink`` and the ring rows ``p % recent`` of the last ``recent`` positions
``p >= max(sink, L - recent)``. Fills are one prefill write, chunks that end at and
around ``sink`` and ``sink + recent``, one-token steps (whole, or as the serving core's window
and INT2 passes), and writes mixed with padding tokens (negative slots), on both backends.

Rotations are signed Hadamard matrices and keys/values dyadic numbers
(``conftest.make_params(exact=True)``), so rotating is exact arithmetic in fp32 and
tf32 alike and the rest of the write is exact by construction (integer bf16 rounding,
``div_rn``, no FMA fusion): the Triton write must then reproduce the expected cache
bit for bit, in the interpreter and on the GPU with its default tf32 rotation.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, fill_cache, needs_triton

from oscar_kernels import CacheLayout
from oscar_math import quantize_int2

SINK, RECENT = 3, 5
LAYOUT = CacheLayout(2, 64, page_size=4, group_size=16, sink_tokens=SINK, recent_tokens=RECENT)
# lengths around the window edges: < sink, = sink, sink+recent-1, sink+recent, +1, +2, longer
LENS = [2, SINK, SINK + RECENT - 1, SINK + RECENT, SINK + RECENT + 1, SINK + RECENT + 2, 19]
EDGES = (SINK - 1, SINK, SINK + 1, SINK + RECENT - 1, SINK + RECENT, SINK + RECENT + 1)
FILLS = {
    "prefill-only": {"cuts": []},
    **{f"cut-at-{e}": {"cuts": [e]} for e in EDGES},
    "chunks-of-2": {"cuts": list(range(2, 19, 2))},
    "steps": {"steps": 4},
    # decode steps as the serving core writes them (BF16 rows, then INT2 rows), padding between
    # the real tokens: the window pass has no early return and loads rows and bookkeeping together
    "steps-window-then-codes-with-padding": {"steps": 4, "pad": 3, "step_parts": ("window", "codes")},
    "prefill-with-padding": {"cuts": [], "pad": 5},
    "chunks-with-padding": {"cuts": [SINK, SINK + RECENT], "pad": 3},
}


def expected_cache(cache, params, bt, ws, keys, values):
    """The cache contents the layout rule prescribes, from raw keys/values (rotated basis)."""
    lo = cache.layout
    ep = params.expand(lo.num_kv_heads, lo.head_dim, torch.device("cpu"))
    want = {
        name: torch.zeros_like(getattr(cache, name), device="cpu")
        for name in ("k_sink", "v_sink", "k_recent", "v_recent")
    }
    int2 = []  # (page, offset, kind, Int2Quantized row)
    for b, (k, v) in enumerate(zip(keys, values, strict=True)):
        n = k.shape[0]
        kr = torch.einsum("nhd,hde->nhe", k.float().cpu() - ep.k_mean, ep.k_rotation)
        vr = torch.einsum("nhd,hde->nhe", v.float().cpu(), ep.v_rotation)
        w = int(ws[b])
        for p in range(n):
            if p < lo.sink_tokens:
                want["k_sink"][w, :, p], want["v_sink"][w, :, p] = kr[p].bfloat16(), vr[p].bfloat16()
            elif p >= n - lo.recent_tokens:
                r = p % lo.recent_tokens
                want["k_recent"][w, :, r], want["v_recent"][w, :, r] = kr[p].bfloat16(), vr[p].bfloat16()
        pos = torch.arange(n)
        page, off = bt[b].cpu().long()[pos // lo.page_size], pos % lo.page_size
        int2.append((page, off, quantize_int2(kr, lo.group, ep.k_clip[:, None]), "k"))
        int2.append((page, off, quantize_int2(vr, lo.group, ep.v_clip[:, None]), "v"))
    return want, int2


def assert_cache_is(cache, want, int2):
    for name, t in want.items():
        got = getattr(cache, name).cpu()
        bad = (got != t).any(-1).nonzero().tolist()  # [slot, head, row] of wrong rows
        assert not bad, f"{name}: {len(bad)} wrong rows, first {bad[:4]}"
    for page, off, q, kind in int2:
        for field in ("codes", "scale", "zero"):
            got = getattr(cache, f"{kind}_{field}").cpu()[page, :, off]
            n_bad = int((got != getattr(q, field)).sum())
            assert n_bad == 0, f"{kind}_{field}: {n_bad} elements differ"


def _fill(backend, fill, seed):
    gen = torch.Generator().manual_seed(seed)
    return fill_cache(LAYOUT, LENS, gen, "kv_head", backend=backend, exact=True, **FILLS[fill])


@pytest.mark.parametrize("fill", list(FILLS))
def test_reference_write_follows_the_window_rule(fill):
    cache, params, bt, ws, keys, values = _fill("torch", fill, 7)
    assert_cache_is(cache, *expected_cache(cache, params, bt, ws, keys, values))


@needs_triton
@pytest.mark.parametrize("fill", list(FILLS))
def test_triton_write_follows_the_window_rule(fill):
    cache, params, bt, ws, keys, values = _fill("triton", fill, 7)
    assert_cache_is(cache, *expected_cache(cache, params, bt, ws, keys, values))


def test_padding_only_write_changes_nothing():
    from oscar_kernels import paged_write, triton_available

    gen = torch.Generator().manual_seed(1)
    cache, params, bt, ws, keys, _ = fill_cache(LAYOUT, [9], gen)
    before = {f: getattr(cache, f).clone() for f in ("k_codes", "k_scale", "k_sink", "k_recent")}
    junk = torch.full((4, 2, 64), 1e4, device=DEVICE).bfloat16()
    z = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    backends = ["torch", "triton"] if triton_available() else ["torch"]
    for backend in backends:
        for parts in ("all", "window"):  # a decode step's window pass has no early return
            paged_write(cache, params, junk, junk, z - 1, z, z, z[:1] + 9, ws, backend=backend, parts=parts)
            for f, t in before.items():
                assert torch.equal(getattr(cache, f), t), (backend, parts, f)


@needs_triton
@pytest.mark.parametrize("block_t", [4, 16])
def test_ring_pass_writes_exactly_the_ring_rows(block_t):
    """``parts="ring"`` (the write after an extend) over whole sequences in blocks of
    ``block_t`` tokens: most blocks hold no ring row and return before rotating, some end one
    sequence and start the next. Starting from ring rows overwritten with junk, the pass
    must restore every ring row of the window rule and touch nothing else."""
    from oscar_kernels import paged_write

    gen = torch.Generator().manual_seed(11)
    lens = [17, 40, 7, 33, 2]  # 17: a block holds only the last ring row of sequence 0
    cache, params, bt, ws, keys, values = fill_cache(LAYOUT, lens, gen, "kv_head", exact=True)
    want, int2 = expected_cache(cache, params, bt, ws, keys, values)
    for name in ("k_recent", "v_recent"):
        getattr(cache, name).fill_(7.0)
    rows = [(b, p) for b, n in enumerate(lens) for p in range(n)]
    b_idx = torch.tensor([r[0] for r in rows])
    pos = torch.tensor([r[1] for r in rows])
    ps = LAYOUT.page_size
    slots = bt.cpu()[b_idx, pos // ps].long() * ps + pos % ps
    k = torch.stack([keys[b][p] for b, p in rows])
    v = torch.stack([values[b][p] for b, p in rows])
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    paged_write(
        cache, params, k, v, slots.to(DEVICE), pos.int().to(DEVICE), b_idx.int().to(DEVICE), sl, ws,
        backend="triton", parts="ring", block_t=block_t,
    )  # fmt: skip
    # rows no sequence's ring uses (slot of the spare window, or recent > length) keep the junk
    used = {(int(ws[b]), p % RECENT) for b, n in enumerate(lens) for p in range(max(SINK, n - RECENT), n)}
    for name in ("k_recent", "v_recent"):
        for w, r in used:
            assert torch.equal(getattr(cache, name)[w, :, r].cpu(), want[name][w, :, r]), (name, w, r)
        junk = [(w, r) for w in range(cache.max_seqs) for r in range(RECENT) if (w, r) not in used]
        assert all((getattr(cache, name)[w, :, r] == 7.0).all() for w, r in junk), name
    assert_cache_is(cache, {k: v for k, v in want.items() if "sink" in k}, int2)  # pages untouched
