"""Shared fixtures: the Triton interpreter on CPU, a cache filled with random tokens."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # kernels import Triton lazily, so this takes effect before any @triton.jit runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install oscar-kernels[triton])"
)


def rand_orth(*shape: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(*shape, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()


def make_params(hkv: int, d: int, granularity: str, gen: torch.Generator):
    from oscar_kernels import LayerQuantParams

    shape = (d, d) if granularity == "layer" else (hkv, d, d)
    return LayerQuantParams(
        rand_orth(*shape, gen=gen),
        rand_orth(*shape, gen=gen),
        k_mean=torch.randn(hkv, d, generator=gen) * 0.5,
        k_clip=0.8 + 0.2 * torch.rand(hkv, generator=gen),
        v_clip=0.9,
    )


def fill_cache(layout, lens, gen, granularity="layer", backend="torch", steps=0):
    """Allocate a cache and write random tokens for sequences of ``lens`` (scattered pages).

    The last ``steps`` tokens of each sequence are written one decode step at a time.
    Returns ``(cache, params, block_table, window_slots, keys, values)``.
    """
    from oscar_kernels import allocate_cache, paged_write

    ps = layout.page_size
    pages = [max(1, -(-n // ps)) for n in lens]
    num_pages = sum(pages) + 2
    perm = torch.randperm(num_pages, generator=gen)
    bt = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[i : i + n].int()
        i += n
    ws = torch.randperm(len(lens) + 1, generator=gen)[: len(lens)].int()
    cache = allocate_cache(layout, num_pages, len(lens) + 1, DEVICE)
    for t in (cache.k_codes, cache.v_codes):  # garbage, not zeros, where nothing was written
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    params = make_params(layout.num_kv_heads, layout.head_dim, granularity, gen)
    h, d = layout.num_kv_heads, layout.head_dim
    keys = [(torch.randn(n, h, d, generator=gen) * 2 + 0.5).bfloat16().to(DEVICE) for n in lens]
    values = [torch.randn(n, h, d, generator=gen).bfloat16().to(DEVICE) for n in lens]

    def write(first, last):
        rows = [(b, p) for b in range(len(lens)) for p in range(first[b], last[b])]
        if not rows:
            return
        b_idx = torch.tensor([r[0] for r in rows])
        pos = torch.tensor([r[1] for r in rows])
        slots = bt[b_idx, pos // ps].long() * ps + pos % ps
        k = torch.stack([keys[b][p] for b, p in rows])
        v = torch.stack([values[b][p] for b, p in rows])
        paged_write(
            cache,
            params,
            k,
            v,
            slots.to(DEVICE),
            pos.int().to(DEVICE),
            b_idx.int().to(DEVICE),
            torch.tensor(last, dtype=torch.int32, device=DEVICE),
            ws.to(DEVICE),
            backend=backend,
        )

    pre = [max(0, n - steps) for n in lens]
    write([0] * len(lens), pre)
    for s in range(steps):
        cur = [min(n, p + s) for n, p in zip(lens, pre, strict=True)]
        write(cur, [min(n, c + 1) for n, c in zip(lens, cur, strict=True)])
    return cache, params, bt.to(DEVICE), ws.to(DEVICE), keys, values
