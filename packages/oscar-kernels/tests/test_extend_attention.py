import pytest
import torch
from conftest import DEVICE, compile_check_ptx, fill_cache, needs_triton

from oscar_kernels import CacheLayout, decode_attention, extend_attention, extend_attention_ref


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@needs_triton
@pytest.mark.parametrize(
    "d, h, g, page, group, granularity",
    [(64, 2, 2, 16, None, "layer"), (32, 1, 4, 8, 16, "kv_head"), (128, 1, 1, 16, None, "kv_head")],
)
def test_extend_triton_matches_reference(d, h, g, page, group, granularity):
    if DEVICE.type == "cuda" and d // 4 < 16:
        pytest.skip("tl.dot needs d/4 >= 16 on a GPU: head dim 32 does not compile in extend_kernel")
    gen = torch.Generator().manual_seed(d + g)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=4, recent_tokens=10)
    lens = [7, 16, 45, 70]
    chunks = [7, 1, 20, 33]  # first chunk, decode-like, chunk > recent, long chunk
    # the chunks' INT2 + sink rows written, their ring rows not yet (the engine's order)
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, granularity, pending=chunks)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    prefix = torch.tensor(
        [n - c for n, c in zip(lens, chunks, strict=True)], dtype=torch.int32, device=DEVICE
    )
    t = sum(chunks)
    q = torch.randn(t, h * g, d, generator=gen).bfloat16().to(DEVICE)
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([values[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    out = extend_attention(
        q, k, v, cache, params, cu, prefix, bt, ws, max(chunks), backend="triton", block_m=16, block_n=16
    )
    ref = extend_attention_ref(
        q, k, v, cache, params.expand(h, d, cache.device), cu, prefix, bt, ws, max(chunks)
    )
    assert torch.isfinite(out).all()
    for b in range(len(lens)):  # per sequence: a batch-wide norm hides one wrong sequence
        s0, s1 = int(cu[b]), int(cu[b + 1])
        assert rel(out[s0:s1], ref[s0:s1]) < 1e-2, (b, lens[b], chunks[b])


def test_extend_of_one_token_equals_decode():
    from oscar_kernels import paged_write

    gen = torch.Generator().manual_seed(5)
    lo = CacheLayout(2, 32, page_size=8, sink_tokens=3, recent_tokens=5)
    lens = [1, 9, 26]
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, pending=[1, 1, 1])
    q = torch.randn(3, 4, 32, generator=gen).float().to(DEVICE)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    k = torch.stack([keys[b][-1] for b in range(3)])
    v = torch.stack([values[b][-1] for b in range(3)])
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    ext = extend_attention(q, k, v, cache, params, cu, sl - 1, bt, ws, 1, backend="torch")
    slots = (bt[torch.arange(3), (sl - 1) // 8].long() * 8 + (sl - 1) % 8).to(DEVICE)
    seq = torch.arange(3, dtype=torch.int32, device=DEVICE)
    paged_write(cache, params, k, v, slots, sl - 1, seq, sl, ws, backend="torch", parts="ring")
    dec = decode_attention(q, cache, params, bt, sl, ws, backend="torch")
    # the same rows under the same rule (the newest token: ring in decode, chunk in extend);
    # only the float32 summation order differs
    assert rel(ext, dec) < (1e-5 if DEVICE.type == "cpu" else 2e-4)


@needs_triton
@pytest.mark.parametrize("rope", [False, True])
def test_extend_kernel_compiles_for_sm90(rope):
    """The extend kernel's GPU path (the interpreter never lowers it) compiles for sm_90 offline,
    with tensor-core dots (``wgmma`` at 64-row blocks) and the PTX unpack of the codes."""
    ptx = compile_check_ptx(f"cc.compile_extend(90, rope={rope})")
    assert ("wgmma" in ptx or "mma.sync.aligned" in ptx) and "prmt.b32" in ptx
