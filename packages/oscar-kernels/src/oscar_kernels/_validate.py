"""Input checks shared by the attention ops (messages name the argument)."""

from __future__ import annotations

import torch

from oscar_math import check

from .layout import PagedKVCache


def check_index_tensor(name: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    check(isinstance(t, torch.Tensor), name, "a torch.Tensor", type(t))
    check(tuple(t.shape) == tuple(shape), f"shape of {name}", list(shape), tuple(t.shape))
    check(t.dtype in (torch.int32, torch.int64), f"dtype of {name}", "torch.int32 or torch.int64", t.dtype)
    check(t.device == device, f"device of {name}", device, t.device)


def check_queries(name: str, q: torch.Tensor, cache: PagedKVCache, ndim: int) -> int:
    """Validate ``[..., H_q, d]`` queries; returns the GQA group size."""
    lo = cache.layout
    check(q.dim() == ndim, f"rank of {name}", ndim, q.dim())
    check(q.shape[-1] == lo.head_dim, f"head dim of {name}", lo.head_dim, q.shape[-1])
    hq = q.shape[-2]
    check(hq % lo.num_kv_heads == 0, f"heads of {name}", f"a multiple of num_kv_heads {lo.num_kv_heads}", hq)
    check(
        q.dtype in (torch.bfloat16, torch.float16, torch.float32),
        f"dtype of {name}",
        "bf16, fp16 or fp32",
        q.dtype,
    )
    check(q.device == cache.device, f"device of {name}", cache.device, q.device)
    return hq // lo.num_kv_heads
