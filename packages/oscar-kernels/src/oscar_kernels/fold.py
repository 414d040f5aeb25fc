"""Fold the value rotation into the attention's output projection (done once, at load time).

The attention output of query head ``h`` is ``o_h = o_rot,h @ R_Vᵀ`` (``R_V`` of its KV head
``h // G``); the output projection then computes ``y = Σ_h o_h @ W_hᵀ`` with ``W_h`` the
``[hidden, d]`` column block of ``W_o`` that reads head ``h``. Hence

    y = Σ_h o_rot,h @ (W_h @ R_V)ᵀ,

so with ``W_h ← W_h @ R_V`` the attention can return ``o_rot`` as it is: every layer's decode
merge and prefill merge lose their ``[d, d]`` un-rotation (:attr:`ExpandedParams.rotated_output`).
The product is formed in float32 and rounded once to the weight's dtype.
"""

from __future__ import annotations

import torch

from oscar_math import check

__all__ = ["fold_output_rotation"]


@torch.no_grad()
def fold_output_rotation(weight: torch.Tensor, v_rotation: torch.Tensor, num_heads: int) -> None:
    """``W_h ← W_h @ R_V[h // G]`` in place, for every query head ``h`` of ``weight``.

    Args:
        weight: ``[out, H_q · d]`` output-projection weight (floating point; a tensor-parallel
            shard holds its rank's heads, ``v_rotation`` then that rank's KV heads).
        v_rotation: ``[H_kv, d, d]`` (or ``[d, d]`` for every head) value rotations.
        num_heads: ``H_q``, a multiple of ``H_kv``.
    """
    check(
        weight.is_floating_point() and weight.dim() == 2,
        "output projection weight",
        "a 2-D floating-point tensor",
        (tuple(weight.shape), weight.dtype),
    )
    rot = v_rotation if v_rotation.dim() == 3 else v_rotation.unsqueeze(0)
    hkv, d = rot.shape[0], rot.shape[-1]
    check(tuple(rot.shape[1:]) == (d, d), "v_rotation shape", "[H_kv, d, d] or [d, d]", tuple(rot.shape))
    check(num_heads % hkv == 0, "query heads", f"a multiple of the {hkv} KV heads", num_heads)
    check(weight.shape[1] == num_heads * d, "output projection input size", num_heads * d, weight.shape[1])
    g = num_heads // hkv
    rot = rot.to(device=weight.device, dtype=torch.float32)
    for h in range(num_heads):
        cols = slice(h * d, (h + 1) * d)
        weight[:, cols] = (weight[:, cols].float() @ rot[h // g]).to(weight.dtype)
