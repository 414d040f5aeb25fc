"""``oscar inspect FILE``: a readable summary of a rotations artifact."""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

__all__ = ["register", "run", "spectrum_summary"]

_SEQ_LENS = (1024, 4096, 32768, 131072)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="summarise a rotations artifact",
        description=(
            "Print an artifact's model, geometry, windows, calibration provenance, bits per "
            "element and, per layer, eigen-spectrum and clip-ratio summaries."
        ),
    )
    p.add_argument("file", metavar="FILE", help="rotations .safetensors file")


def spectrum_summary(eigenvalues: torch.Tensor) -> tuple[float, float]:
    """``[G, d]`` eigenvalues → (top-eigenvalue share, effective rank), averaged over ``G``.

    Effective rank is ``exp(entropy(λ / Σλ))``: ``d`` for a flat spectrum, 1 when one
    direction holds everything. ``(nan, nan)`` when the eigenvalues are unknown (zeros).
    """
    lam = eigenvalues.double().clamp(min=0)
    total = lam.sum(-1, keepdim=True)
    if bool((total <= 0).any()):
        return math.nan, math.nan
    p = lam / total
    entropy = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    return float(p.amax(-1).mean()), float(entropy.exp().mean())


def _fmt(x: float, digits: int = 2) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def _clip(c: torch.Tensor) -> str:
    if c.numel() == 1:
        return f"{float(c):.3f}"
    return f"{float(c.min()):.3f}/{float(c.mean()):.3f}/{float(c.max()):.3f}"


def _rope_pairs(m: Any) -> int:
    half = m.shape[-1] // 2
    return int(((m[:, :half] != 0) | (m[:, half:] != 0)).any(0).sum())


def _rope_summary(rot: Any) -> str:
    """One line on the pre-RoPE key mean (format version 3) of an artifact."""
    if rot.k_rope_mean is None:
        return "no (INT2 keys centred by the static mean only)"
    pairs = [_rope_pairs(m) for m in rot.k_rope_mean]
    return (
        f"yes, {min(pairs)}-{max(pairs)} of {rot.head_dim // 2} frequency pairs per layer; INT2 keys at "
        f"position p centred by RoPE_p(m) (format version {rot.format_version})"
    )


def run(args: argparse.Namespace) -> int:
    from oscar_math.artifact import load_rotations
    from oscar_math.bits import bits_per_element

    from . import format_table

    rot = load_rotations(args.file)
    cal = dict(rot.calibration)
    g = rot.num_groups
    lines = [
        f"file          {args.file}",
        f"model         {rot.model}",
        f"layers        {rot.num_layers}",
        f"KV heads      {rot.num_kv_heads}",
        f"head dim      {rot.head_dim}",
        f"group size    {rot.group_size}",
        f"granularity   {rot.granularity.value} ({g} rotation{'s' if g > 1 else ''} per layer, K and V)",
        f"windows       {rot.sink_tokens} sink + {rot.recent_tokens} recent tokens in BF16",
        f"key mean      {'yes (subtracted before rotation)' if rot.k_mean is not None else 'no'}",
        f"pre-RoPE mean {_rope_summary(rot)}",
        "codes         "
        + (
            "error feedback for "
            + " and ".join(
                n for n, f in (("keys", rot.k_feedback), ("values", rot.v_feedback)) if f is not None
            )
            + f" (format version {rot.format_version})"
            if rot.has_feedback
            else f"plain rounding (format version {rot.format_version})"
        ),
    ]
    if cal:
        parts = []
        for key in ("tokens", "seq_len", "text", "seed", "tool_version"):
            if key in cal:
                parts.append(f"{key} {cal[key]}")
        extra = [k for k in cal if k not in ("tokens", "seq_len", "text", "seed", "tool_version", "config")]
        lines.append(f"calibration   {', '.join(parts) if parts else '-'}")
        if "clip_error_ratio" in cal:
            ratio = cal["clip_error_ratio"]
            lines.append(
                f"clip gain     calibration error vs no clipping: K x{ratio.get('k')}, V x{ratio.get('v')}"
            )
        other = [k for k in extra if k not in ("clip_error_ratio", "rope_mean")]
        if other:
            lines.append("              " + ", ".join(f"{k} {cal[k]}" for k in other))
    bits = ", ".join(
        f"{n // 1024}k: {bits_per_element(n, rot.head_dim, group_size=rot.group_size, sink_tokens=rot.sink_tokens, recent_tokens=rot.recent_tokens):.3f}"  # noqa: E501
        for n in _SEQ_LENS
    )
    lines.append(f"bits/element  {bits}  (INT2 + 16-bit scale/zero + BF16 windows)")
    print("\n".join(lines))
    print()
    rows = []
    for i in range(rot.num_layers):
        layer = rot.for_layer(i)
        k_top, k_rank = spectrum_summary(layer.k_eigenvalues)
        v_top, v_rank = spectrum_summary(layer.v_eigenvalues)
        k_mean = "-" if layer.k_mean is None else f"{float(layer.k_mean.norm(dim=-1).mean()):.2f}"
        rows.append(
            [
                i,
                _fmt(k_top, 3),
                _fmt(k_rank, 1),
                _fmt(v_top, 3),
                _fmt(v_rank, 1),
                _clip(layer.k_clip),
                _clip(layer.v_clip),
                k_mean,
            ]
        )
    clip_head = "clip" if g == 1 else "clip min/mean/max"
    header = [
        "layer",
        "K top",
        "K eff.rank",
        "V top",
        "V eff.rank",
        f"K {clip_head}",
        f"V {clip_head}",
        "|k_mean|",
    ]
    print(format_table(header, rows, align="rrrrrrrr"))
    print()
    print(
        "K/V top: share of the largest eigenvalue of C_Q / C_S; eff.rank: exp(entropy of the "
        "spectrum), mean over rotation groups; |k_mean|: norm of the key mean."
    )
    return 0
