"""Small dense rotations done once per call around the attention kernels (torch).

``q_rot = q @ R_K`` once per step (instead of un-rotating every key) and
``o = o_rot @ R_Vᵀ`` once after the merge; keys/values of a prefill chunk are
rotated the same way the write kernel rotates them. All in float32, then rounded to
the dtype the kernels read (bf16), so the Triton path and the torch reference see
identical inputs.
"""

from __future__ import annotations

import torch

from .params import ExpandedParams

__all__ = ["rotate_queries", "rotate_chunk", "unrotate_output"]


def _per_head_matmul(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``x[..., H_kv, G, d] @ rot[H_kv, d, d]``; one matmul when ``rot`` is shared.

    Per head, one batched matmul of every token's ``[G, d]`` rows with that head's rotation
    expanded over the tokens (stride 0): the product a token gets is the same ``[G, d] @ [d, d]``
    whatever else is in the batch (outputs must not depend on batching or chunking), and ``rot``
    is never materialised per token (``x @ rot`` broadcast it: 8 GiB for a 16k-token chunk at 8 KV
    heads × 128).
    """
    if rot.stride(0) == 0:  # one rotation per layer, expanded with stride 0
        return x @ rot[0]
    *lead, h, g, d = x.shape
    flat = x.reshape(-1, h, g, d)
    n = flat.shape[0]
    heads = [torch.bmm(flat[:, i], rot[i].expand(n, d, d)) for i in range(h)]
    return torch.stack(heads, dim=1).reshape(*lead, h, g, d)


def rotate_queries(q: torch.Tensor, ep: ExpandedParams, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``[..., H_q, d]`` → ``q @ R_K`` of each query head's KV head, in ``dtype``."""
    h = ep.k_rotation.shape[0]
    *lead, hq, d = q.shape
    x = q.float().reshape(*lead, h, hq // h, d)
    return _per_head_matmul(x, ep.k_rotation).reshape(q.shape).to(dtype)


def rotate_chunk(
    k: torch.Tensor, v: torch.Tensor, ep: ExpandedParams, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, H_kv, d]`` keys/values → ``((k - k_mean) @ R_K, v @ R_V)`` in ``dtype``."""
    kf = (k.float() - ep.k_mean).unsqueeze(-2)  # [T, H, 1, d]
    vf = v.float().unsqueeze(-2)
    kr = _per_head_matmul(kf, ep.k_rotation).squeeze(-2)
    vr = _per_head_matmul(vf, ep.v_rotation).squeeze(-2)
    return kr.to(dtype), vr.to(dtype)


def unrotate_output(o: torch.Tensor, ep: ExpandedParams, dtype: torch.dtype) -> torch.Tensor:
    """``[..., H_q, d]`` float32 rotated output → ``o @ R_Vᵀ`` in ``dtype``."""
    h = ep.v_rotation.shape[0]
    *lead, hq, d = o.shape
    x = o.float().reshape(*lead, h, hq // h, d)
    return _per_head_matmul(x, ep.v_rotation.transpose(-1, -2)).reshape(o.shape).to(dtype)
