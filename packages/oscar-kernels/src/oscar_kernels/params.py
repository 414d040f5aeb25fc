"""Per-layer quantisation parameters the kernels consume, as plain tensors.

The rotations artifact (``oscar_math.artifact``) stores exactly these; the kernels do
not depend on it. Row-vector convention: ``k_rot = (k - k_mean) @ k_rotation``,
``v_rot = v @ v_rotation``; queries are rotated by ``q @ k_rotation`` (keys centred
by ``k_mean`` need no query correction: softmax is shift-invariant per query) and the
output is un-rotated once by ``o_rot @ v_rotationᵀ``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from oscar_math import check
from oscar_math.rope_center import compact_rope_mean

__all__ = ["LayerQuantParams", "ExpandedParams", "as_expanded"]


@dataclass(frozen=True)
class ExpandedParams:
    """Per-KV-head view of :class:`LayerQuantParams` (float32, on the cache device).

    Attributes:
        k_rotation, v_rotation: ``[H_kv, d, d]`` (stride 0 on dim 0 for one per layer).
        k_mean: ``[H_kv, d]`` (zeros when absent).
        k_clip, v_clip: ``[H_kv]`` ratios in ``(0, 1]``.
        k_feedback, v_feedback: ``[H_kv, d, d]`` strictly lower-triangular error-feedback
            matrices in the rotated basis, or None (plain rounding); :meth:`LayerQuantParams.expand`
            stores them column-major per head (strides ``(d², 1, d)``), the layout the write reads
            fastest (any strides are read correctly).
        k_rope_mean: ``[H_kv, d]`` dense pre-RoPE key mean of the INT2 rows
            (:mod:`oscar_math.rope_center`), or None (no position-dependent centering).
        k_rope_inv_freq: ``[d/2]`` RoPE inverse frequencies (with ``k_rope_mean``).
        k_rope_ab, k_rope_theta, k_rope_pairs: the compact form the kernels read,
            ``[H_kv, 2, R]`` / ``[R]`` float32 / ``[R]`` int64 (``R`` a power of two; see
            :func:`oscar_math.rope_center.compact_rope_mean`), or None.
        rotated_output: the attention outputs stay in the rotated value basis (``o_rot``, no
            ``o_rot @ R_Vᵀ``): the engine folded ``R_V`` into its output projection
            (``W_o[:, head h] ← W_o[:, head h] @ R_V[kv(h)]``; :func:`fold_output_rotation`),
            which spares every layer the un-rotation. Default False: outputs in the model's basis.
    """

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_mean: torch.Tensor
    k_clip: torch.Tensor
    v_clip: torch.Tensor
    has_mean: bool
    k_feedback: torch.Tensor | None = None
    v_feedback: torch.Tensor | None = None
    k_rope_mean: torch.Tensor | None = None
    k_rope_inv_freq: torch.Tensor | None = None
    k_rope_ab: torch.Tensor | None = None
    k_rope_theta: torch.Tensor | None = None
    k_rope_pairs: torch.Tensor | None = None
    rotated_output: bool = False

    @property
    def rope_pairs(self) -> int:
        """``R``, the number of pair slots of the score term (0 without a pre-RoPE mean)."""
        return 0 if self.k_rope_theta is None else int(self.k_rope_theta.shape[0])


@dataclass(frozen=True)
class LayerQuantParams:
    """Rotation, centring and clipping of one layer.

    Attributes:
        k_rotation, v_rotation: ``[d, d]`` (granularity ``layer``) or ``[H_kv, d, d]``
            (granularity ``kv_head``) float32 orthogonal matrices.
        k_mean: ``None``, ``[d]`` or ``[H_kv, d]`` — key mean in the original basis.
        k_clip, v_clip: float, or ``[H_kv]`` / ``[1]`` tensor, in ``(0, 1]`` (1 = no clip).
        k_feedback, v_feedback: ``None`` (plain rounding), ``[d, d]`` or ``[H_kv, d, d]``
            strictly lower-triangular error-feedback matrices (``oscar_math.feedback``, format
            version 2 of the artifact): the codes are rounded coordinate by coordinate with each
            error fed forward. Scale, zero and the cache layout are unchanged.
        k_rope_mean: ``None``, ``[d]`` or ``[H_kv, d]`` — pre-RoPE key mean of the INT2 rows,
            zero outside the selected frequency pairs (format version 3;
            :mod:`oscar_math.rope_center`): INT2 rows of position ``p`` are centred by
            ``RoPE_p(m)`` and attention adds ``q·RoPE_p(m)`` back per INT2 key.
        k_rope_inv_freq: ``None`` or ``[d/2]`` RoPE inverse frequencies; given with ``k_rope_mean``.
    """

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_mean: torch.Tensor | None = None
    k_clip: float | torch.Tensor = 1.0
    v_clip: float | torch.Tensor = 1.0
    k_feedback: torch.Tensor | None = None
    v_feedback: torch.Tensor | None = None
    k_rope_mean: torch.Tensor | None = None
    k_rope_inv_freq: torch.Tensor | None = None

    @classmethod
    def from_rotations(cls, rotations: Any, layer: int) -> LayerQuantParams:
        """Layer ``layer`` of an :class:`oscar_math.artifact.Rotations` (a loaded artifact).

        ``layer`` granularity (``G = 1``) gives ``[d, d]`` rotations, ``kv_head`` gives
        ``[H_kv, d, d]``; clip ratios, the key mean and the error-feedback matrices (if the
        artifact has them) are taken as stored.
        """
        check(
            isinstance(layer, int) and 0 <= layer < rotations.num_layers,
            "layer",
            f"an index in [0, {rotations.num_layers})",
            layer,
        )
        lay = rotations.for_layer(layer)
        squeeze = rotations.granularity == "layer"

        def one(t: torch.Tensor | None) -> torch.Tensor | None:
            return t[0] if (t is not None and squeeze) else t

        return cls(
            k_rotation=one(lay.k_rotation),
            v_rotation=one(lay.v_rotation),
            k_mean=one(lay.k_mean),
            k_clip=lay.k_clip,
            v_clip=lay.v_clip,
            k_feedback=one(getattr(lay, "k_feedback", None)),
            v_feedback=one(getattr(lay, "v_feedback", None)),
            k_rope_mean=one(getattr(lay, "k_rope_mean", None)),
            k_rope_inv_freq=getattr(rotations, "rope_inv_freq", None),
        )

    @property
    def granularity(self) -> str:
        return "layer" if self.k_rotation.dim() == 2 else "kv_head"

    def expand(self, num_kv_heads: int, head_dim: int, device: torch.device) -> ExpandedParams:
        """Validate and broadcast to one set per KV head (see :class:`ExpandedParams`)."""
        h, d = num_kv_heads, head_dim
        rots = []
        for name in ("k_rotation", "v_rotation"):
            r = getattr(self, name)
            check(
                isinstance(r, torch.Tensor) and r.shape in ((d, d), (h, d, d)),
                f"shape of {name}",
                f"({d}, {d}) or ({h}, {d}, {d})",
                tuple(r.shape) if isinstance(r, torch.Tensor) else type(r),
            )
            r = r.to(device=device, dtype=torch.float32).contiguous()
            rots.append(r.unsqueeze(0).expand(h, d, d) if r.dim() == 2 else r.contiguous())
        if self.k_mean is None:
            mean = torch.zeros(h, d, dtype=torch.float32, device=device)
        else:
            m = self.k_mean
            check(m.shape in ((d,), (h, d)), "shape of k_mean", f"({d},) or ({h}, {d})", tuple(m.shape))
            mean = m.to(device=device, dtype=torch.float32).expand(h, d).contiguous()
        clips = []
        for name in ("k_clip", "v_clip"):
            c = torch.as_tensor(getattr(self, name), dtype=torch.float32).reshape(-1)
            check(c.numel() in (1, h), f"size of {name}", f"1 or {h}", c.numel())
            check(
                bool(torch.isfinite(c).all() and (c > 0).all() and (c <= 1).all()),
                name,
                "values in (0, 1]",
                c.tolist(),
            )
            clips.append(c.to(device).expand(h).contiguous())
        fbs = []
        for name in ("k_feedback", "v_feedback"):
            f = getattr(self, name)
            if f is None:
                fbs.append(None)
                continue
            check(
                isinstance(f, torch.Tensor) and f.shape in ((d, d), (h, d, d)),
                f"shape of {name}",
                f"({d}, {d}) or ({h}, {d}, {d})",
                tuple(f.shape) if isinstance(f, torch.Tensor) else type(f),
            )
            f = f.to(device=device, dtype=torch.float32)
            # one host check at load time: the kernels read only the strictly lower part's
            # columns in order, so anything on or above the diagonal would be silently ignored
            check(bool(torch.isfinite(f).all()), name, "finite values", "NaN/Inf")
            check(
                not bool(torch.triu(f).ne(0).any()),
                name,
                "strictly lower triangular",
                "nonzero entries on/above the diagonal",
            )
            # column-major per head (row stride 1): the write's feedback loop reads F a column at a
            # time, four columns a step; row-major, each column is d/4 cache lines a quarter
            fbs.append(f.expand(h, d, d).transpose(1, 2).contiguous().transpose(1, 2))
        return ExpandedParams(
            rots[0], rots[1], mean, clips[0], clips[1], self.k_mean is not None, fbs[0], fbs[1],
            **self._expand_rope(h, d, device),
        )  # fmt: skip

    def _expand_rope(self, h: int, d: int, device: torch.device) -> dict[str, torch.Tensor]:
        m, f = self.k_rope_mean, self.k_rope_inv_freq
        check(
            (m is None) == (f is None),
            "k_rope_mean / k_rope_inv_freq",
            "both or neither",
            (m is None, f is None),
        )
        if m is None:
            return {}
        check(m.shape in ((d,), (h, d)), "shape of k_rope_mean", f"({d},) or ({h}, {d})", tuple(m.shape))
        check(tuple(f.shape) == (d // 2,), "shape of k_rope_inv_freq", (d // 2,), tuple(f.shape))
        m = m.to(device=device, dtype=torch.float32).expand(h, d).contiguous()
        f = f.to(device=device, dtype=torch.float32).contiguous()
        check(
            bool(torch.isfinite(m).all() and torch.isfinite(f).all()),
            "k_rope_mean",
            "finite values",
            "NaN/Inf",
        )
        ab, theta, pairs = compact_rope_mean(m, f)
        return {
            "k_rope_mean": m,
            "k_rope_inv_freq": f,
            "k_rope_ab": ab,
            "k_rope_theta": theta,
            "k_rope_pairs": pairs,
        }


def as_expanded(
    params: LayerQuantParams | ExpandedParams, num_kv_heads: int, head_dim: int, device: torch.device
) -> ExpandedParams:
    """Accept either form; expand (once, with host checks) when given the compact one.

    Engines should expand once at load time and pass :class:`ExpandedParams` so the
    per-step path has no host synchronisation.
    """
    if isinstance(params, ExpandedParams):
        return params
    check(isinstance(params, LayerQuantParams), "params", "LayerQuantParams or ExpandedParams", type(params))
    return params.expand(num_kv_heads, head_dim, device)
