"""Small dense rotations done once per call around the attention kernels.

``q_rot = q @ R_K`` once per step (instead of un-rotating every key) and
``o = o_rot @ R_Vᵀ`` once after the merge; keys/values of a prefill chunk are
rotated the same way the write kernel rotates them. All in float32, then rounded to
the dtype the kernels read (bf16), so the Triton path and the torch reference see
identical inputs. On CUDA one Triton launch per call (``kernels/rotate.py``: fixed tiles,
3×TF32 products of float32 accuracy); the torch form below is its reference and the path
everywhere else. The Triton path is the one that is batch-invariant on CUDA: cuBLAS picks a
``bmm`` algorithm by batch count, so the torch form's bits there depend on the batch (measured
on the H200); on CPU both are.
"""

from __future__ import annotations

import torch

from ._backend import Backend, use_triton
from .launch import launch
from .params import ExpandedParams

__all__ = ["rotate_queries", "rotate_chunk", "unrotate_output", "merge_unrotate", "merge_two_ref"]

# fixed, whatever the row count: a token's products must not depend on its batch
_BLOCK_M, _BLOCK_N, _WARPS = 64, 64, 4


def _per_head_matmul_ref(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``x[..., H_kv, G, d] @ rot[H_kv, d, d]`` in torch; one matmul when ``rot`` is shared.

    Per head, one batched matmul of every token's ``[G, d]`` rows with that head's rotation
    expanded over the tokens (stride 0), so ``rot`` is never materialised per token (``x @ rot``
    broadcast it: 8 GiB for a 16k-token chunk at 8 KV heads × 128). On CPU the product a token gets
    does not depend on the rest of the batch; on CUDA it does (cuBLAS picks the algorithm by batch
    count), which is why CUDA takes the Triton kernel.
    """
    if rot.stride(0) == 0:  # one rotation per layer, expanded with stride 0
        return x @ rot[0]
    *lead, h, g, d = x.shape
    flat = x.reshape(-1, h, g, d)
    n = flat.shape[0]
    heads = [torch.bmm(flat[:, i], rot[i].expand(n, d, d)) for i in range(h)]
    return torch.stack(heads, dim=1).reshape(*lead, h, g, d)


def _rotate(
    x: torch.Tensor,
    rot: torch.Tensor,
    dtype: torch.dtype,
    mean: torch.Tensor | None = None,
    backend: Backend | str = "auto",
) -> torch.Tensor:
    """``((x - mean) @ rot)`` per KV head at float32 accuracy (3×TF32 on the Triton path),
    rounded to ``dtype``.

    Args:
        x: ``[..., H_kv, G, d]`` any float dtype.
        rot: ``[H_kv, d, d]`` float32 (any strides: a transposed view rotates by ``rotᵀ``).
        mean: ``[H_kv, d]`` float32 subtracted first (keys' mean), or ``None``.
    Returns:
        ``x``'s shape in ``dtype``.
    """
    *lead, h, g, d = x.shape
    pow2 = d >= 16 and d & (d - 1) == 0
    if not (pow2 and use_triton(x.device, backend)):
        xf = x.float() if mean is None else x.float() - mean.unsqueeze(-2)
        return _per_head_matmul_ref(xf, rot).to(dtype)
    from .kernels.rotate import rotate_tiles_kernel

    flat = x.reshape(-1, h, g, d)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    n = flat.shape[0]
    out = torch.empty((n, h, g, d), dtype=dtype, device=x.device)
    rows = n * g
    if rows:
        m = mean if mean is not None else rot  # not read without HAS_MEAN
        grid = ((rows + _BLOCK_M - 1) // _BLOCK_M, h)
        launch(rotate_tiles_kernel, grid,
            flat, flat.stride(0), flat.stride(1), flat.stride(2),
            rot, rot.stride(0), rot.stride(1), rot.stride(2),
            m, m.stride(0), out, rows, g,
            H=h, D=d, BLOCK_M=_BLOCK_M, BLOCK_N=min(_BLOCK_N, d), HAS_MEAN=mean is not None,
            num_warps=_WARPS,
        )  # fmt: skip
    return out.reshape(*lead, h, g, d)


def rotate_queries(
    q: torch.Tensor, ep: ExpandedParams, dtype: torch.dtype = torch.bfloat16, backend: Backend | str = "auto"
) -> torch.Tensor:
    """``[..., H_q, d]`` → ``q @ R_K`` of each query head's KV head, in ``dtype``."""
    h = ep.k_rotation.shape[0]
    *lead, hq, d = q.shape
    x = q.reshape(*lead, h, hq // h, d)
    return _rotate(x, ep.k_rotation, dtype, backend=backend).reshape(q.shape)


def rotate_chunk(
    k: torch.Tensor,
    v: torch.Tensor,
    ep: ExpandedParams,
    dtype: torch.dtype = torch.bfloat16,
    backend: Backend | str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H_kv, d]`` keys/values → ``((k - k_mean) @ R_K, v @ R_V)`` in ``dtype``."""
    kr = _rotate(k.unsqueeze(-2), ep.k_rotation, dtype, mean=ep.k_mean, backend=backend).squeeze(-2)
    vr = _rotate(v.unsqueeze(-2), ep.v_rotation, dtype, backend=backend).squeeze(-2)
    return kr, vr


def unrotate_output(
    o: torch.Tensor, ep: ExpandedParams, dtype: torch.dtype, backend: Backend | str = "auto"
) -> torch.Tensor:
    """``[..., H_q, d]`` float32 rotated output → ``o @ R_Vᵀ`` in ``dtype`` (``o`` itself where
    ``ep.rotated_output``: the engine's output projection holds ``R_V``)."""
    if ep.rotated_output:
        return o.to(dtype)
    h = ep.v_rotation.shape[0]
    *lead, hq, d = o.shape
    x = o.reshape(*lead, h, hq // h, d)
    return _rotate(x, ep.v_rotation.transpose(-1, -2), dtype, backend=backend).reshape(o.shape)


def merge_two_ref(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Two partial attentions over disjoint key sets → their union's output (float32).

    ``o1/o2 [T, H_q, d]``, ``l1/l2 [H_q, T]`` natural-log sums (FlashAttention's layout); a set
    without keys for a row (``l`` infinite, FlashAttention's ``+inf``, or NaN) weighs nothing.
    Returns ``[T, H_q, d]`` float32 (0 where neither set has keys)."""
    ok1, ok2 = torch.isfinite(l1).t()[..., None], torch.isfinite(l2).t()[..., None]  # [T, H, 1]
    l1 = torch.where(ok1, l1.t()[..., None], float("-inf"))
    l2 = torch.where(ok2, l2.t()[..., None], float("-inf"))
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isfinite(m), m, 0.0)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    den = (w1 + w2).clamp_min(1e-30)
    o1 = torch.where(ok1, o1.float(), 0.0)
    o2 = torch.where(ok2, o2.float(), 0.0)
    return (o1 * w1 + o2 * w2) / den


def merge_unrotate(
    o1: torch.Tensor,
    l1: torch.Tensor,
    o2: torch.Tensor | None,
    l2: torch.Tensor | None,
    ep: ExpandedParams,
    dtype: torch.dtype,
    backend: Backend | str = "auto",
) -> torch.Tensor:
    """``unrotate_output(merge_two_ref(o1, l1, o2, l2), ep, dtype)`` in one pass.

    ``o1/o2 [T, H_q, d]`` (any float dtype, unit last stride), ``l1/l2 [H_q, T]`` float32 (any
    strides); ``o2 = l2 = None``: one key set. On CUDA one Triton launch
    (``kernels/rotate.py``'s ``merge_unrotate_kernel``): the merged float32 rows never reach memory
    (the torch form writes and re-reads ``[T, H_q, d]`` float32 about eight times: the prefill's
    largest elementwise cost, H200 profile of 2026-12-04). Returns ``[T, H_q, d]`` in ``dtype``
    (merged only, not un-rotated, where ``ep.rotated_output``)."""
    h = ep.v_rotation.shape[0]
    t, hq, d = o1.shape
    pow2 = d >= 16 and d & (d - 1) == 0
    if not (pow2 and use_triton(o1.device, backend)):
        if o2 is None:
            o2, l2 = torch.zeros_like(o1), torch.full_like(l1, float("-inf"))
        return unrotate_output(merge_two_ref(o1, l1, o2, l2), ep, dtype, backend="torch")
    from .kernels.rotate import merge_unrotate_kernel

    o1 = o1 if o1.stride(-1) == 1 else o1.contiguous()
    two = o2 is not None
    if two:
        o2 = o2 if o2.stride(-1) == 1 else o2.contiguous()
    else:
        o2, l2 = o1, l1  # not read
    out = torch.empty((t, hq, d), dtype=dtype, device=o1.device)
    g = hq // h
    rows = t * g
    if rows:
        rot = ep.v_rotation.transpose(-1, -2)
        grid = ((rows + _BLOCK_M - 1) // _BLOCK_M, h)
        launch(merge_unrotate_kernel, grid,
            o1, o1.stride(0), o1.stride(1), l1, l1.stride(0), l1.stride(1),
            o2, o2.stride(0), o2.stride(1), l2, l2.stride(0), l2.stride(1),
            rot, rot.stride(0), rot.stride(1), rot.stride(2),
            out, rows, g,
            H=h, D=d, BLOCK_M=_BLOCK_M, BLOCK_N=min(_BLOCK_N, d), TWO=two, ROTATE=not ep.rotated_output,
            num_warps=_WARPS,
        )  # fmt: skip
    return out
