import pytest
import torch
from conftest import DEVICE, fill_cache, needs_triton

from oscar_kernels import CacheLayout, KernelUnavailableError, decode_attention, decode_attention_ref
from oscar_math import OscarError


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@needs_triton
@pytest.mark.parametrize(
    "impl, unpack",
    [("dot", "asm"), ("fma", "asm"), ("fma", "convert"), ("fma-kt", "asm"), ("fma-t", "asm")],
    ids=["dot", "fma", "fma-convert", "fma-kt", "fma-t"],
)
@pytest.mark.parametrize(
    "d, h, g, page, group, granularity, splits",
    [
        (64, 2, 4, 16, None, "layer", 3),
        (64, 1, 1, 8, 32, "kv_head", 1),  # group = 2 quarters: folded per quarter
        (128, 2, 8, 16, None, "kv_head", 2),
        (32, 3, 3, 4, 8, "layer", 5),  # group = one quarter
        (64, 2, 4, 8, 4, "layer", 2),  # group < quarter: per-element dequantisation
    ],
)
def test_decode_triton_matches_reference(d, h, g, page, group, granularity, splits, impl, unpack):
    if DEVICE.type == "cuda" and impl == "dot" and d // 4 < 16:
        pytest.skip("tl.dot needs d/4 >= 16 on a GPU: head dim 32 does not compile with impl='dot'")
    gen = torch.Generator().manual_seed(d * g)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=5, recent_tokens=12)
    # empty, shorter than the sink, = sink + recent, one over, page boundaries, longer
    lens = [0, 3, 17, 18, 2 * page, 2 * page + 1, 83]
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, granularity, steps=2)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), h * g, d, generator=gen).bfloat16().to(DEVICE)
    out = decode_attention(
        q,
        cache,
        params,
        bt,
        sl,
        ws,
        backend="triton",
        num_splits=splits,
        block_n=16,
        impl=impl,
        unpack=unpack,
    )
    ref = decode_attention_ref(q, cache, params.expand(h, d, cache.device), bt, sl, ws)
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0  # empty sequence
    for b in range(1, len(lens)):
        assert rel(out[b], ref[b]) < 1e-2, (b, lens[b])


def test_decode_input_errors():
    gen = torch.Generator().manual_seed(0)
    lo = CacheLayout(2, 32, page_size=8, sink_tokens=2, recent_tokens=3)
    cache, params, bt, ws, _, _ = fill_cache(lo, [9], gen)
    sl = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 32, device=DEVICE)
    with pytest.raises(OscarError, match="heads of q"):
        decode_attention(q[:, :3], cache, params, bt, sl, ws)
    with pytest.raises(OscarError, match="dtype of seq_lens"):
        decode_attention(q, cache, params, bt, sl.float(), ws)
    with pytest.raises(OscarError, match="backend"):
        decode_attention(q, cache, params, bt, sl, ws, backend="cuda")
    with pytest.raises(OscarError, match="impl"):
        decode_attention(q, cache, params, bt, sl, ws, impl="wmma")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU refusal of the Triton backend")
def test_triton_backend_refused_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(0)
    lo = CacheLayout(1, 16, page_size=4, sink_tokens=1, recent_tokens=1)
    cache, params, bt, ws, _, _ = fill_cache(lo, [5], gen)
    q = torch.randn(1, 1, 16)
    with pytest.raises(KernelUnavailableError, match="backend='torch'"):
        decode_attention(q, cache, params, bt, torch.tensor([5], dtype=torch.int32), ws, backend="triton")


@needs_triton
def test_decode_and_write_on_engine_buffer_views():
    """The kernels take page strides as given: a cache viewed into one byte buffer per layer
    (how an engine hands its KV tensor over) gives the same results as a plain one."""
    from oscar_kernels import allocate_cache, cache_from_page_buffer, page_bytes, paged_write
    from oscar_math import unpack_int2

    gen = torch.Generator().manual_seed(9)
    lo = CacheLayout(2, 64, page_size=8, sink_tokens=3, recent_tokens=5)
    lens = [4, 19, 30]
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, steps=1)
    buf = torch.zeros(cache.num_pages, page_bytes(lo) + 64, dtype=torch.uint8, device=DEVICE)[:, 64:]
    view = cache_from_page_buffer(lo, buf, cache.max_seqs)
    for f in ("k_sink", "v_sink", "k_recent", "v_recent"):
        getattr(view, f).copy_(getattr(cache, f))
    # rewrite every token through the Triton write into the views, in one batch
    rows = [(b, p) for b in range(len(lens)) for p in range(lens[b])]
    b_idx = torch.tensor([r[0] for r in rows])
    pos = torch.tensor([r[1] for r in rows])
    slots = bt.cpu()[b_idx, pos // 8].long() * 8 + pos % 8
    k = torch.stack([keys[b][p] for b, p in rows])
    v = torch.stack([values[b][p] for b, p in rows])
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    paged_write(
        view,
        params,
        k,
        v,
        slots.to(DEVICE),
        pos.int().to(DEVICE),
        b_idx.int().to(DEVICE),
        sl,
        ws,
        backend="triton",
    )
    plain = allocate_cache(lo, cache.num_pages, cache.max_seqs, DEVICE)
    paged_write(
        plain,
        params,
        k,
        v,
        slots.to(DEVICE),
        pos.int().to(DEVICE),
        b_idx.int().to(DEVICE),
        sl,
        ws,
        backend="torch",
    )
    pg, off = slots // 8, slots % 8
    for f in ("k_codes", "v_codes"):
        diff = (
            unpack_int2(getattr(view, f)[pg, :, off]).int() - unpack_int2(getattr(plain, f)[pg, :, off]).int()
        )
        assert (diff != 0).float().mean() <= 5e-3 and diff.abs().max() <= 1
    q = torch.randn(3, 4, 64, generator=gen).bfloat16().to(DEVICE)
    o_view = decode_attention(q, view, params, bt, sl, ws, backend="triton", block_n=16, num_splits=2)
    o_ref = decode_attention_ref(q, view, params.expand(2, 64, view.device), bt, sl, ws)
    for b in range(3):
        assert rel(o_view[b], o_ref[b]) < 1e-2
