"""OSCAR's prefill through vLLM's own FlashAttention (``compat.dense_attention``), on the GPU.

The kernel must have the semantics ``oscar_kernels.dense_attention_ref`` states (bottom-right
causal, left window, log-sum-exp, empty rows), and the whole dense extend must match the torch
reference of the window rule and the Triton extend kernel. Skipped, with the reason, where there
is no CUDA device or vLLM has no FlashAttention (the CPU build).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device: vLLM's FlashAttention runs on the GPU only", allow_module_level=True)

from oscar_kernels import (  # noqa: E402
    CacheLayout,
    LayerQuantParams,
    allocate_cache,
    dense_attention_ref,
    extend_attention,
    extend_attention_ref,
    paged_write,
)
from oscar_vllm import compat  # noqa: E402

DEV = torch.device("cuda")


@pytest.fixture(scope="module")
def fa():
    attn = compat.dense_attention(128)
    if attn is None:
        pytest.skip("vLLM has no FlashAttention here")
    return attn


@pytest.mark.parametrize("window", [-1, 0, 255])
def test_flash_attention_has_the_reference_semantics(fa, window):
    gen = torch.Generator().manual_seed(window + 2)
    qlens, klens = [300, 1, 40, 7, 64], [700, 90, 10, 0, 64]
    cu_q = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, *torch.tensor(klens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(qlens), 32, 128, generator=gen).bfloat16().to(DEV)
    k = torch.randn(sum(klens), 8, 128, generator=gen).bfloat16().to(DEV)
    v = torch.randn(sum(klens), 8, 128, generator=gen).bfloat16().to(DEV)
    out, lse = fa(q, k, v, cu_q, cu_k, max(qlens), max(klens), 0.088, window)
    ref, ref_lse = dense_attention_ref(q, k, v, cu_q, cu_k, max(qlens), max(klens), 0.088, window)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    ok = torch.isfinite(ref_lse)
    assert (~torch.isfinite(lse[~ok])).all()  # rows without keys: infinite, as the merge expects
    torch.testing.assert_close(lse[ok], ref_lse[ok], atol=2e-3, rtol=1e-3)
    rows = ok.all(0)
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), atol=2e-2, rtol=2e-2)


def _random_cache(lo, lens, pending, gen):
    ps = lo.page_size
    pages = [-(-n // ps) for n in lens]
    perm = torch.randperm(sum(pages) + 2, generator=gen)
    bt = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[i : i + n].int()
        i += n
    cache = allocate_cache(lo, sum(pages) + 2, len(lens) + 1, DEV)
    h, d = lo.num_kv_heads, lo.head_dim
    rot = torch.linalg.qr(torch.randn(h, d, d, generator=gen))[0]
    params = LayerQuantParams(rot, rot.flip(-1), k_mean=0.3 * torch.randn(h, d, generator=gen), k_clip=0.9)
    keys = [(2 * torch.randn(n, h, d, generator=gen) + 0.5).bfloat16().to(DEV) for n in lens]
    vals = [torch.randn(n, h, d, generator=gen).bfloat16().to(DEV) for n in lens]
    ws = torch.arange(len(lens), dtype=torch.int32, device=DEV) + 1
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)

    def write(first, last, parts):
        rows = [(b, p) for b in range(len(lens)) for p in range(first[b], last[b])]
        b_idx = torch.tensor([r[0] for r in rows])
        pos = torch.tensor([r[1] for r in rows])
        slots = (bt[b_idx, pos // ps].long() * ps + pos % ps).to(DEV)
        k = torch.stack([keys[b][p] for b, p in rows])
        v = torch.stack([vals[b][p] for b, p in rows])
        pos, b_idx = pos.int().to(DEV), b_idx.int().to(DEV)
        paged_write(cache, params, k, v, slots, pos, b_idx, seq_lens, ws, parts=parts)

    done = [n - c for n, c in zip(lens, pending, strict=True)]
    if any(done):
        write([0] * len(lens), done, "all")
    write(done, lens, "pages")
    return cache, params, bt.to(DEV), ws, keys, vals


def test_dense_extend_matches_reference_and_triton(fa):
    gen = torch.Generator().manual_seed(7)
    lo = CacheLayout(8, 128, page_size=16, sink_tokens=64, recent_tokens=256)
    lens = [900, 33, 2100, 700, 1500]  # decodes first (as vLLM orders them), then chunks
    chunks = [1, 1, 700, 700, 1024]  # a chunk after a prefix, a first chunk, one > recent
    cache, params, bt, ws, keys, vals = _random_cache(lo, lens, chunks, gen)
    ep = params.expand(8, 128, DEV)
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    pre = torch.tensor([n - c for n, c in zip(lens, chunks, strict=True)], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(chunks), 32, 128, generator=gen).bfloat16().to(DEV)
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([vals[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    args = (q, k, v, cache, ep, cu, pre, bt, ws, max(chunks))
    dense = extend_attention(*args, dense=fa, host_lens=(chunks, [n + 5 for n in lens]))
    triton = extend_attention(*args)
    ref = extend_attention_ref(*args)
    assert torch.isfinite(dense).all()
    for b in range(len(lens)):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        for name, x in (("dense", dense), ("triton", triton)):
            err = float((x[s0:s1].float() - ref[s0:s1]).norm() / ref[s0:s1].float().norm())
            assert err < 1e-2, (name, b, err)
