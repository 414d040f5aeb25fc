import pytest
import torch
from conftest import DEVICE, compile_check_ptx, fill_cache, needs_triton

from oscar_kernels import CacheLayout, decode_attention, extend_attention, extend_attention_ref


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@needs_triton
@pytest.mark.parametrize(
    "d, h, g, page, group, granularity, block_m",
    [
        (64, 2, 2, 16, None, "layer", 16),  # 8 tokens x 2 heads per program
        (32, 1, 4, 8, 16, "kv_head", 16),
        (128, 1, 1, 16, None, "kv_head", 16),
        (64, 2, 3, 16, None, "kv_head", None),  # GQA 3: 21 tokens x 3 heads of 64 rows, one unused
        (64, 1, 4, 16, None, "kv_head", 32),  # fewer rows than a chunk: 8 tokens per program
    ],
)
def test_extend_triton_matches_reference(d, h, g, page, group, granularity, block_m):
    """Rows of a program are (token, query head) pairs of one KV head: every sequence's outputs
    match the reference for GQA 1-4 (3 leaves rows unused), blocks of 1 to 21 tokens."""
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
        q, k, v, cache, params, cu, prefix, bt, ws, max(chunks), backend="triton", block_m=block_m, block_n=16
    )
    ref = extend_attention_ref(
        q, k, v, cache, params.expand(h, d, cache.device), cu, prefix, bt, ws, max(chunks)
    )
    assert torch.isfinite(out).all()
    for b in range(len(lens)):  # per sequence: a batch-wide norm hides one wrong sequence
        s0, s1 = int(cu[b]), int(cu[b + 1])
        assert rel(out[s0:s1], ref[s0:s1]) < 1e-2, (b, lens[b], chunks[b])


def _chunks_with_rope_term(lo, lens, chunks, g, gen):
    """``extend_attention``'s arguments for chunks ``chunks`` ending sequences of ``lens`` tokens
    (their INT2 and sink rows written, ring rows pending), with a pre-RoPE key mean on 4 pairs."""
    from oscar_kernels import LayerQuantParams

    h, d = lo.num_kv_heads, lo.head_dim
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, "kv_head", pending=chunks)
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    mean = torch.zeros(h, d)
    mean[:, d // 2 - 4 : d // 2] = 2 * torch.randn(h, 4, generator=gen)
    rope = LayerQuantParams(
        params.k_rotation, params.v_rotation, k_rope_mean=mean, k_rope_inv_freq=inv
    ).expand(h, d, DEVICE)
    cu = torch.tensor([0] + torch.tensor(chunks).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    prefix = torch.tensor(
        [n - c for n, c in zip(lens, chunks, strict=True)], dtype=torch.int32, device=DEVICE
    )
    q = torch.randn(sum(chunks), h * g, d, generator=gen).bfloat16().to(DEVICE)
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([values[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    return (q, k, v, cache, rope, cu, prefix, bt, ws, max(chunks))


@needs_triton
@pytest.mark.parametrize("splits", [2, 3, 7, "auto"])
def test_split_extend_matches_the_unsplit_kernel_and_the_reference(splits):
    """Splitting each query block's INT2 keys over programs (a short chunk over a long prefix)
    gives the unsplit kernel's outputs up to float32 summation order: long prefixes, chunks that
    straddle pages and the windows, a decode-like row, a row whose INT2 range is empty, and the
    pre-RoPE mean's score term."""
    from oscar_kernels.extend_attention import choose_extend_splits

    d, h, g, page = 64, 2, 2, 16
    if DEVICE.type == "cuda":
        pytest.skip("on a GPU: test_split_extend_at_the_engines_shape")
    gen = torch.Generator().manual_seed(11)
    lo = CacheLayout(h, d, page_size=page, sink_tokens=4, recent_tokens=10)
    lens = [301, 17, 12, 260]
    chunks = [16, 1, 12, 5]  # a hit's tail, a decode, a first chunk (no INT2 keys), a short tail
    args = _chunks_with_rope_term(lo, lens, chunks, g, gen)
    cu = args[5]
    one = extend_attention(*args, backend="triton", block_m=16, block_n=16)
    split = extend_attention(*args, backend="triton", block_m=16, block_n=16, num_splits=splits)
    ref = extend_attention_ref(*args)
    for b in range(len(lens)):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        assert rel(split[s0:s1], one[s0:s1]) < 2e-3, (b, splits)
        assert rel(split[s0:s1], ref[s0:s1]) < 1e-2, (b, splits)
    if splits == "auto":  # 1 query block x 4 rows x 4 heads = 16 programs on a "4-SM" CPU: no split
        assert choose_extend_splits(16, 320, 16, DEVICE) == 1
        assert (
            choose_extend_splits(2, 100_000, 64, DEVICE) == 4
            and choose_extend_splits(3, 100_000, 64, DEVICE) == 2  # ceil(8 / 3) = 3, a power of two below
            and choose_extend_splits(2, 400, 64, DEVICE) == 1
        )
    with pytest.raises(Exception, match="num_splits"):
        extend_attention(*args, backend="triton", num_splits=0)
    if splits == 2:  # the count is a run-time argument: every count shares one compiled kernel
        from oscar_kernels.launch import record_launches

        keys = []
        for n in (2, 4, 16, 64):
            with record_launches(dry=True) as seen:
                extend_attention(*args, backend="triton", block_m=16, block_n=16, num_splits=n)
            keys.append({k for k in seen if k[0] == "extend_kernel"})
        assert len(keys[0]) == 1 and all(k == keys[0] for k in keys), keys


@needs_triton
@pytest.mark.parametrize(
    "page, sink, group, splits",
    [(16, 16, None, 1), (32, 0, None, 3), (16, 16, 16, 1), (32, 16, 16, 2), (16, 0, None, "auto")],
)
def test_tiles_of_one_page_match_the_reference(page, sink, group, splits):
    """Pages and sinks in whole tiles (vLLM's 64-token pages, 64-row sinks): the kernel reads a
    tile's page a tile ahead and, with one scale/zero per row, its scales and zeros a tile ahead
    (``PAGE_TILES``). Chunks over prefixes of many pages, ending mid-page and mid-tile, split and
    not, the pre-RoPE term on: each sequence as the reference."""
    from oscar_kernels.launch import record_launches

    d, h, g = 64, 2, 2
    if DEVICE.type == "cuda":
        d = 128  # tl.dot needs d/4 >= 16 on a GPU
    gen = torch.Generator().manual_seed(page + sink + (group or 0))
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=10)
    lens = [301, 17, 130, 260]
    chunks = [16, 1, 40, 5]
    args = _chunks_with_rope_term(lo, lens, chunks, g, gen)
    cu = args[5]
    calls: dict = {}
    with record_launches(dry=True, calls=calls):
        extend_attention(*args, backend="triton", block_m=16, block_n=16, num_splits=splits)
    assert [c[3]["PAGE_TILES"] for c in calls.values() if c[0].fn.__name__ == "extend_kernel"] == [True]
    out = extend_attention(*args, backend="triton", block_m=16, block_n=16, num_splits=splits)
    ref = extend_attention_ref(*args)
    for b in range(len(lens)):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        assert rel(out[s0:s1], ref[s0:s1]) < 1e-2, (b, lens[b], chunks[b])


@needs_triton
@pytest.mark.skipif(DEVICE.type != "cuda", reason="the engine's shape on the GPU (CPU: the test above)")
def test_split_extend_at_the_engines_shape():
    """Qwen3-8B's attention shape, 64-token pages: a 16-token tail over a 20k prefix and a decode
    row, split as the engine's ``auto`` rule picks, against the unsplit kernel."""
    from oscar_kernels.extend_attention import choose_extend_splits

    d, h, g, page = 128, 8, 4, 64
    gen = torch.Generator().manual_seed(3)
    lo = CacheLayout(h, d, page_size=page)
    lens, chunks = [20000, 3001], [16, 1]
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, "kv_head", pending=chunks)
    cu = torch.tensor([0, 16, 17], dtype=torch.int32, device=DEVICE)
    prefix = torch.tensor(
        [n - c for n, c in zip(lens, chunks, strict=True)], dtype=torch.int32, device=DEVICE
    )
    q = torch.randn(17, h * g, d, generator=gen).bfloat16().to(DEVICE)
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([values[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    args = (q, k, v, cache, params, cu, prefix, bt, ws, 16)
    assert choose_extend_splits(2 * h * g, max(lens), 64, DEVICE) > 1
    one = extend_attention(*args)
    split = extend_attention(*args, num_splits="auto", host_lens=(chunks, lens))
    for b in range(2):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        assert rel(split[s0:s1], one[s0:s1]) < 5e-3, b


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
@pytest.mark.parametrize("rope, splits", [(False, 1), (True, 1), (True, 8)])
def test_extend_kernel_compiles_for_sm90(rope, splits):
    """The extend kernel's GPU path (the interpreter never lowers it) compiles for sm_90 offline,
    with tensor-core dots (``wgmma`` at 64-row blocks) and the PTX unpack of the codes; also the
    split-INT2 variant."""
    ptx = compile_check_ptx(f"cc.compile_extend(90, rope={rope}, splits={splits})")
    assert ("wgmma" in ptx or "mma.sync.aligned" in ptx) and "prmt.b32" in ptx


@needs_triton
def test_the_extend_kernels_rope_term_spills_next_to_nothing_and_does_not_branch():
    """With the pre-RoPE term the extend kernel spilled 2,172 bytes a thread (``tl.dot``'s
    ``tf32x3`` split both operands every tile; the kernel took 1.9× its time without the term on the
    H100, 48 prefix-hit tails over 100k): the basis split once per program, the products added into
    the score tile, it spills at most a few dozen bytes (ptxas, sm_90, 4 warps and 2 stages as
    :func:`extend_attention` launches it, 64-token pages)."""
    import importlib.util
    from pathlib import Path

    ptx = compile_check_ptx("cc.compile_extend(90, rope=True, num_stages=2)")
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_check.py"
    spec = importlib.util.spec_from_file_location("compile_check", path)
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    rep = cc.ptxas_report(ptx, 90)
    if not rep["ptxas_ok"] or rep["spill_store_bytes"] is None:
        pytest.skip("no ptxas that takes this Triton's PTX")
    assert rep["spill_store_bytes"] <= 128, rep
    # each tile's angles by the approximate sine and cosine: libdevice's cosf/sinf put their slow
    # path's branches into the INT2 loop (58 of them; the loop half as long again as without the term)
    assert "cos.approx.f32" in ptx and "sin.approx.f32" in ptx
    int2_loop = max(cc.ptx_loops(ptx), key=lambda lp: lp["lines"])
    assert int2_loop["bra"] <= 4, int2_loop


def test_extend_block_m_fills_the_dot_with_one_chunks_rows():
    from oscar_kernels import extend_block_m

    assert extend_block_m(16, 4) == 64  # a prefix hit's 16-token tail at GQA 4: one full program
    assert extend_block_m(1, 4) == 16 and extend_block_m(1, 1) == 16  # tl.dot's smallest M
    assert extend_block_m(5, 3) == 16 and extend_block_m(6, 3) == 32
    assert extend_block_m(4096, 8) == 64  # long chunks: many programs of 8 tokens x 8 heads
    assert extend_block_m(1, 128) == 128  # every head of a KV head in one program
