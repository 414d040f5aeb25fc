"""Extend attention through a dense flash-attention kernel (``extend_dense``) against the torch
reference of the window rule, with the dense kernel's torch reference standing in for
FlashAttention (the GPU tests of oscar-vllm run the real one)."""

import dataclasses

import pytest
import torch
from conftest import (
    DEVICE,
    compile_check_ptx,
    extend_batch,
    fill_cache,
    needs_triton,
    record_triton_specialisations,
)

from oscar_kernels import (
    CacheLayout,
    dense_attention_ref,
    extend_attention,
    extend_attention_ref,
    torch_flash_attention,
)

#: the dense kernels the path is tested with: the reference everywhere, torch's FA2 on a GPU (the
#: fallback both engines take when theirs is missing or fails its start-up check)
ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="torch's FlashAttention runs on CUDA only")
DENSE = ["ref", pytest.param("torch-fa2", marks=ON_GPU)]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _brute(q, k, v, scale, allowed):
    """One sequence, ``allowed [m, n]``: softmax attention and its log-sum-exp, GQA by repeat."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("mhd,nhd->hmn", q.double(), k.double().repeat_interleave(g, 1)) * scale
    s = s.masked_fill(~allowed[None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hmn,nhd->mhd", p, v.double().repeat_interleave(g, 1)), lse


@pytest.mark.parametrize("window", [-1, 0, 3])
def test_dense_reference_is_bottom_right_causal_with_a_left_window(window):
    gen = torch.Generator().manual_seed(3 + window)
    qlens, klens = [5, 1, 4, 3], [9, 6, 2, 0]  # keys > queries, one query, fewer keys, no keys
    cu_q = torch.tensor([0, 5, 6, 10, 13], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 15, 17, 17], dtype=torch.int32)
    q = torch.randn(13, 4, 8, generator=gen)
    k, v = torch.randn(17, 2, 8, generator=gen), torch.randn(17, 2, 8, generator=gen)
    out, lse = dense_attention_ref(q, k, v, cu_q, cu_k, 5, 9, 0.3, window)
    for b, (m, n) in enumerate(zip(qlens, klens, strict=True)):
        i = torch.arange(m)[:, None]
        j = torch.arange(n)[None, :]
        ok = j <= i + n - m
        if window >= 0:
            ok &= j >= i + n - m - window
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        want, want_lse = _brute(q[q0 : q0 + m], k[k0 : k0 + n], v[k0 : k0 + n], 0.3, ok)
        torch.testing.assert_close(out[q0 : q0 + m].double(), want, atol=1e-5, rtol=1e-5)
        has = ok.any(1)
        got = lse[:, q0 : q0 + m]
        assert torch.isinf(got[:, ~has]).all() and (got[:, ~has] > 0).all()  # FlashAttention's +inf
        assert (out[q0 : q0 + m][~has] == 0).all()
        torch.testing.assert_close(got[:, has].double(), want_lse[:, has], atol=1e-5, rtol=1e-5)


def _with_rope(params, h, d, pairs, gen):
    m = torch.zeros(h, d)
    idx = torch.arange(pairs)
    m[:, idx] = 3 * torch.randn(h, pairs, generator=gen)
    m[:, idx + d // 2] = 3 * torch.randn(h, pairs, generator=gen)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    return dataclasses.replace(params, k_rope_mean=m, k_rope_inv_freq=inv)


CASES = {
    # lens (after the step), chunks: prefill from 0 shorter / longer than recent, a chunk whose
    # prefix is shorter than recent, a chunk after a long prefix, page-boundary crossings
    "prefills": ([7, 45, 70, 33], [7, 20, 33, 33]),
    # the engine's mixed batch: decodes first (Triton), then chunks (dense)
    "mixed": ([26, 9, 1, 50, 17], [1, 1, 1, 24, 17]),
    "one-chunk": ([130], [64]),
}


@needs_triton
@pytest.mark.parametrize("dense", DENSE)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "sink, recent, rope, granularity", [(4, 10, 0, "layer"), (0, 16, 4, "kv_head"), (5, 1, 0, "kv_head")]
)
def test_dense_extend_matches_reference(case, sink, recent, rope, granularity, dense):
    lens, chunks = CASES[case]
    h, g, d = 2, 2, 64
    gen = torch.Generator().manual_seed(len(lens) * 7 + sink + recent)
    lo = CacheLayout(h, d, page_size=16, sink_tokens=sink, recent_tokens=recent)
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, granularity, pending=chunks)
    if rope:
        params = _with_rope(params, h, d, rope, gen)
    ep = params.expand(h, d, cache.device)
    q, k, v, cu, pre = extend_batch(lens, chunks, keys, values, h * g, gen)
    ref = extend_attention_ref(q, k, v, cache, ep, cu, pre, bt, ws, max(chunks))
    out = extend_attention(
        q, k, v, cache, ep, cu, pre, bt, ws, max(chunks), backend="triton",
        dense=dense_attention_ref if dense == "ref" else torch_flash_attention(),
        host_lens=(chunks, [n + 3 for n in lens]),  # loose bounds
        dense_min_query=2,  # every chunk but the decodes through the dense path
    )  # fmt: skip
    assert torch.isfinite(out).all()
    for b in range(len(lens)):  # per sequence and per token: a batch norm hides one wrong row
        s0, s1 = int(cu[b]), int(cu[b + 1])
        assert rel(out[s0:s1], ref[s0:s1]) < 1e-2, (b, lens[b], chunks[b])
        per_token = (out[s0:s1].float() - ref[s0:s1].float()).norm(dim=(1, 2)) / ref[s0:s1].float().norm(
            dim=(1, 2)
        )
        assert float(per_token.max()) < 3e-2, (b, per_token)


@needs_triton
def test_dense_extend_reads_lengths_back_when_not_given():
    lens, chunks = [40, 19], [22, 19]
    gen = torch.Generator().manual_seed(11)
    lo = CacheLayout(1, 64, page_size=16, sink_tokens=3, recent_tokens=8)
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, pending=chunks)
    cu = torch.tensor([0, 22, 41], dtype=torch.int32, device=DEVICE)
    pre = torch.tensor([18, 0], dtype=torch.int32, device=DEVICE)
    q = torch.randn(41, 4, 64, generator=gen).bfloat16().to(DEVICE)
    k = torch.cat([keys[0][18:], keys[1]])
    v = torch.cat([values[0][18:], values[1]])
    args = (q, k, v, cache, params, cu, pre, bt, ws, 22)
    kw = dict(backend="triton", dense=dense_attention_ref, dense_min_query=2)
    a = extend_attention(*args, **kw)
    b = extend_attention(*args, **kw, host_lens=([22, 19], [40, 19]))
    assert torch.equal(a, b)
    ref = extend_attention_ref(q, k, v, cache, params.expand(1, 64, cache.device), cu, pre, bt, ws, 22)
    assert rel(a, ref) < 1e-2


def test_dense_runs_route_short_chunks_to_triton_and_cap_the_far_set():
    from oscar_kernels.extend_attention import dense_runs

    # decodes, a long chunk, a short tail (a prefix-cache hit), two long chunks, a padding row
    q, n = [1, 1, 40, 5, 30, 50, 0], [9, 12, 100, 105, 60, 80, 0]
    assert dense_runs(q, n, recent=10, min_query=30) == [
        (0, 2, False),
        (2, 3, True),
        (3, 4, False),
        (4, 7, True),
    ]
    # far rows 90 | 50 + 70 > 100: the second long range splits; a row over the cap stays alone
    assert dense_runs(q, n, 10, 30, max_far_rows=100) == [
        (0, 2, False), (2, 3, True), (3, 4, False), (4, 5, True), (5, 7, True),
    ]  # fmt: skip
    assert dense_runs([1, 1], [5, 6], 10, 2) == [(0, 2, False)]
    assert dense_runs([], [], 10, 2) == []


@needs_triton
@pytest.mark.parametrize("cap", [10**6, 40])
def test_interleaved_short_and_long_chunks_match_the_reference(cap, monkeypatch):
    """Rows alternate between the Triton kernel and the dense path (and dense ranges split at a
    small far-set cap): each row's output is the reference's."""
    import importlib

    ext_mod = importlib.import_module("oscar_kernels.extend_attention")

    monkeypatch.setattr(ext_mod, "DENSE_MAX_FAR_ROWS", cap)
    lens, chunks = [30, 60, 25, 9, 70, 41], [1, 20, 3, 9, 25, 18]
    h, g, d = 2, 2, 64
    gen = torch.Generator().manual_seed(23)
    lo = CacheLayout(h, d, page_size=16, sink_tokens=3, recent_tokens=6)
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, pending=chunks)
    ep = params.expand(h, d, cache.device)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    pre = torch.tensor([n - c for n, c in zip(lens, chunks, strict=True)], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(chunks), h * g, d, generator=gen).bfloat16().to(DEVICE)
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([values[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    calls = []

    def attn(*a, **kw):
        calls.append(int(a[4][-1]))  # far/near keys of the call
        return dense_attention_ref(*a, **kw)

    ref = extend_attention_ref(q, k, v, cache, ep, cu, pre, bt, ws, max(chunks))
    out = extend_attention(
        q, k, v, cache, ep, cu, pre, bt, ws, max(chunks), backend="triton", dense=attn,
        host_lens=(chunks, lens), dense_min_query=9,
    )  # fmt: skip
    assert calls, "no row went through the dense path"
    for b in range(len(lens)):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        assert rel(out[s0:s1], ref[s0:s1]) < 1e-2, (b, lens[b], chunks[b])


@needs_triton
@pytest.mark.parametrize("sink, rope, group", [(4, 0, 64), (0, 4, 32), (5, 8, 16)])
def test_far_rows_kernel_matches_the_torch_form(sink, rope, group):
    """The Triton far rows (dequantised INT2, sink rows, the RoPE term) against the torch form on
    random caches: bitwise without a pre-RoPE mean and for values (the same float32 operations),
    within a bf16 rounding step of it with one (float32 polynomial angles, 3xTF32 product).
    77 rows in two sequences: page boundaries (16-token pages), sink rows, a partial tile, rows
    past a sequence's end (they read the table's last column: the same page in both forms)."""
    from oscar_kernels.extend_dense import _far_rows, _far_rows_torch

    h, d = 2, 64
    gen = torch.Generator().manual_seed(17 + sink + rope + group)
    lens = [70, 41]
    lo = CacheLayout(h, d, page_size=16, group_size=group, sink_tokens=sink, recent_tokens=8)
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, "kv_head")
    if rope:
        params = _with_rope(params, h, d, rope, gen)
    ep = params.expand(h, d, cache.device)
    seq = torch.tensor([0] * 50 + [1] * 27, device=DEVICE)
    pos = torch.cat([torch.arange(50), torch.arange(20, 47)]).to(DEVICE)  # 41..46 past sequence 1's end
    k, v = _far_rows(cache, ep, bt, ws, seq, pos, torch.bfloat16)
    k_ref, v_ref = _far_rows_torch(cache, ep, bt, ws, seq, pos, torch.bfloat16)
    assert k.dtype == torch.bfloat16 and k.shape == (77, h, d)
    assert torch.equal(v, v_ref)
    if rope:
        diff = (k.float() - k_ref.float()).abs()
        assert float(diff.max()) <= float(k_ref.float().abs().max()) * 2**-7
        assert float((diff > 0).float().mean()) < 0.02  # only rows at a rounding boundary differ
        # the RoPE term is there (a kernel that drops it is far off)
        k_plain, _ = _far_rows_torch(
            cache, dataclasses.replace(ep, k_rope_mean=None), bt, ws, seq, pos, torch.bfloat16
        )
        assert float((k_plain.float() - k_ref.float()).abs().max()) > 0.1
    else:
        assert torch.equal(k, k_ref)
    if sink:  # the sink rows are the BF16 rows themselves
        s = ws[0].long()
        torch.testing.assert_close(
            k[:sink], cache.k_sink[s, :, :sink].transpose(0, 1).to(k.dtype), rtol=0, atol=0
        )


@needs_triton
@pytest.mark.parametrize("sink, d", [(4, 64), (0, 64), (3, 48)])
def test_near_rows_kernel_equals_the_torch_form(sink, d):
    """The Triton near rows (the chunk's own rows, the prefix's sink and ring rows) against the
    torch form, bitwise: three sequences (prefix 0, a prefix inside the sink, a prefix past the
    ring), a head size that is not a power of two, a partial tile and rows past a segment (they
    clamp into the chunk in both forms)."""
    from oscar_kernels.extend_dense import _near_rows, _near_rows_torch

    h, r = 2, 8
    gen = torch.Generator().manual_seed(41 + sink + d)
    lo = CacheLayout(h, d, page_size=16, group_size=16, sink_tokens=sink, recent_tokens=r)
    lens, chunks = [5, 9, 40], [5, 6, 11]
    cache, _, _, ws, _, _ = fill_cache(lo, lens, gen, "kv_head", pending=chunks)
    pre = [n - c for n, c in zip(lens, chunks, strict=True)]
    seq, pos = [], []
    for b, (p0, c) in enumerate(zip(pre, chunks, strict=True)):
        first = max(p0 - r + 1, 0)
        seq += [b] * (p0 + c - first)
        pos += list(range(first, p0 + c))
    seq += [2, 2, 2]  # rows past the last segment, as _segments pads them
    pos += [51, 52, 53]
    k_rot = torch.randn(sum(chunks), h, d, generator=gen).bfloat16().to(DEVICE)
    v_rot = torch.randn(sum(chunks), h, d, generator=gen).bfloat16().to(DEVICE)
    seq_t, pos_t = torch.tensor(seq, device=DEVICE), torch.tensor(pos, device=DEVICE)
    prefix = torch.tensor(pre, dtype=torch.int32, device=DEVICE)
    start = torch.tensor([0, 5, 11], device=DEVICE)
    args = (cache, k_rot, v_rot, ws, seq_t, pos_t, prefix, start)
    k, v = _near_rows(*args)
    k_ref, v_ref = _near_rows_torch(*args)
    assert k.shape == (len(seq), h, d) and k.dtype == torch.bfloat16
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    # both sources are used: the chunk's rows and the prefix's window rows
    mine = pos_t >= prefix[seq_t]
    assert mine.any() and (~mine).any()
    assert not torch.equal(k[~mine], torch.zeros_like(k[~mine]))


@needs_triton
@pytest.mark.parametrize("sink", [64, 0])
def test_near_rows_kernel_compiles_for_sm90(sink):
    ptx = compile_check_ptx(f"cc.compile_near_rows(90, sink={sink})")
    assert "st.global" in ptx


@needs_triton
@pytest.mark.parametrize("splits", [1, 2])
def test_a_run_at_any_row_offset_compiles_nothing_new(monkeypatch, splits):
    """A step's rows run in ranges (``dense_runs``): a dense or Triton range that starts at row
    ``a > 0`` passes ``block_table[a:b]``, ``window_slots[a:b]`` and ``prefix[a:b]``, views whose
    addresses are not 16-byte aligned for most ``a``. Triton specialises pointers on alignment by
    default, so each offset compiled the far-rows kernel anew during serving (vLLM's JIT monitor on
    the H200, 2026-12-04: ``far_rows_kernel`` in a mixed step).

    Every launch of the range (rotations, far rows, extend, the split merge) must compile at
    offsets 1-3 exactly what it compiled at offset 0, by OSCAR's key and by Triton's own binder
    (``triton_specialisation``). A kernel may compile several specialisations per range: the
    rotation kernel runs for q, k (with the mean), v and the output (transposed rotation), four
    compiles at any offset, all made by the warm-up (the H100 run of 2026-12-05 failed this test's
    earlier form, which wanted one key per kernel name, on exactly those four). On the CPU the
    rotations go through their Triton kernel here, as on a GPU, so the CPU run sees their keys."""
    from oscar_kernels.extend_dense import _far_rows
    from oscar_kernels.launch import record_launches

    record_triton_specialisations(monkeypatch)
    h, g, d = 2, 2, 64
    gen = torch.Generator().manual_seed(29)
    lens, chunks = [70, 41], [5, 3]
    lo = CacheLayout(h, d, page_size=16, sink_tokens=3, recent_tokens=8)
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, "kv_head", pending=chunks)
    assert bt.shape[1] % 4 != 0  # rows of the table are then not all 16-byte aligned
    ep = params.expand(h, d, cache.device)
    seq = torch.tensor([0] * 50 + [1] * 27, device=DEVICE)
    pos = torch.cat([torch.arange(50), torch.arange(20, 47)]).to(DEVICE)
    cu = torch.tensor([0, 5, 8], dtype=torch.int32, device=DEVICE)
    q = torch.randn(8, h * g, d, generator=gen).bfloat16().to(DEVICE)
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([values[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    pre = torch.tensor([n - c for n, c in zip(lens, chunks, strict=True)], dtype=torch.int32, device=DEVICE)
    by_offset = []
    for a in range(4):
        # the step's other rows first, then this range's two sequences at rows a, a + 1
        tab = torch.cat([torch.zeros(a, bt.shape[1], dtype=bt.dtype, device=DEVICE), bt])[a:]
        slots = torch.cat([torch.zeros(a, dtype=ws.dtype, device=DEVICE), ws])[a:]
        prefix = torch.cat([torch.zeros(a, dtype=pre.dtype, device=DEVICE), pre])[a:]
        with record_launches(dry=True) as seen:
            _far_rows(cache, ep, tab, slots, seq, pos, torch.bfloat16)
            extend_attention(
                q, k, v, cache, ep, cu, prefix, tab, slots, 5, backend="triton", check_bounds=False,
                num_splits=splits,
            )  # fmt: skip
        by_offset.append(seen)
    names = {key[0] for key in by_offset[0]}
    want = {"far_rows_kernel", "extend_kernel", "rotate_tiles_kernel"}
    from oscar_kernels.decode_attention import DEFAULT_TUNING

    merge = {  # merge_partials' default
        "v1": {"merge_splits_kernel"},
        "v2": {"merge_cols_kernel", "unrotate_rows_kernel"},
    }[DEFAULT_TUNING.merge_impl]
    assert want | (merge if splits > 1 else set()) <= names
    for a, seen in enumerate(by_offset[1:], 1):
        new = sorted({key[0] for key in seen - by_offset[0]})
        assert not new, f"row offset {a} compiles new specialisations of {new}"
