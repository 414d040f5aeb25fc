"""Position-aware key centering, in emulation only (NOT servable with format version 1).

The artifact's key mean ``k_mean`` is one vector per KV head in the post-RoPE basis. RoPE
turns each frequency pair of a key by ``ω_j·p``, so the post-RoPE mean of pairs whose
period is comparable to the context (on SmolLM2 pairs 17-24, periods ~3k-25k positions)
depends on which positions were averaged: the mean calibrated on chunks of 1024 tokens
and the one calibrated on chunks of 8192 differ by 60-100 % of their norm
(docs/results.md, "Long context, third study"). A static mean can suit one context length
only.

This module measures what centering by the **pre-RoPE** mean would give: the mean
``m`` of the keys before RoPE (estimated as ``mean_p RoPE_{-p}(k_p)`` over calibration
positions past the sink), subtracted at each position ``p`` as ``RoPE_p(m)``::

    k̂_p = Q(k_p − RoPE_p(m)) + RoPE_p(m)

Unlike the static mean this is not free at serving time: ``q·RoPE_p(m)`` differs between
keys, so a kernel would have to add it back per INT2 key (one RoPE of a stored vector and a
dot product per key, no extra bytes) — a format and kernel change, not made here. The
emulation adds it back exactly, so it bounds what such a change could buy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from oscar_math.errors import check

from .attention import attention_override
from .schemes import KVScheme, RowCodec

__all__ = ["STATIC_ROPE_TYPES", "RopeMeanScheme", "apply_rope", "prerope_key_means", "rope_inv_freq"]

#: RoPE variants whose inverse frequencies are fixed once the model is built (servable with a
#: stored ``rope_inv_freq``, artifact format version 3).
STATIC_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(model: Any) -> torch.Tensor:
    """``[d/2]`` float64 RoPE inverse frequencies of a llama-family model (default RoPE only).

    Raises:
        OscarError: the model has no rotary embedding or uses a scaled RoPE variant.
    """
    rot = getattr(getattr(model, "model", model), "rotary_emb", None)
    check(rot is not None and hasattr(rot, "inv_freq"), "model", "a model with model.rotary_emb", None)
    scaling = float(getattr(rot, "attention_scaling", 1.0))
    check(scaling == 1.0, "rope attention_scaling", "1.0 (default RoPE)", scaling)
    # dynamic variants change inv_freq with the sequence length at run time; the stored one
    # would be wrong past the original context (static ones scale inv_freq once, at init)
    kind = str(getattr(rot, "rope_type", "default"))
    check(kind in STATIC_ROPE_TYPES, "rope_type", f"one of {STATIC_ROPE_TYPES}", kind)
    return rot.inv_freq.detach().double().cpu()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' llama applies it (``x·cos + rotate_half(x)·sin``), on ``[T, H, d]``.

    ``positions``: ``[T]`` (negative positions invert the rotation).
    """
    ang = positions.to(torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]  # [T, d/2]
    ang = torch.cat((ang, ang), dim=-1)[:, None, :]  # [T, 1, d]
    cos, sin = ang.cos(), ang.sin()
    xd = x.double()
    half = xd.shape[-1] // 2
    rotated = torch.cat((-xd[..., half:], xd[..., :half]), dim=-1)
    return (xd * cos + rotated * sin).to(x.dtype)


@torch.no_grad()
def prerope_key_means(
    model: Any, chunks: Sequence[torch.Tensor], *, sink: int = 64, layers: int | None = None
) -> list[torch.Tensor]:
    """Per layer ``[H_kv, d]`` float32 mean of the keys before RoPE (positions ``>= sink``).

    The keys reach the attention function after RoPE; each is rotated back by its own
    position (``RoPE_{-p}``) before averaging, so no model code is copied.
    """
    from .simulate import exact_attention

    inv_freq = rope_inv_freq(model)
    sums: dict[int, torch.Tensor] = {}
    count = 0

    def fn(ctx: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float, **kw: Any) -> Any:
        b, _, s, _ = key.shape
        pos = torch.arange(sink, s)
        k = key[:, :, sink:].transpose(1, 2).reshape(b * (s - sink), key.shape[1], key.shape[3])
        pre = apply_rope(k.double().cpu(), -pos.repeat(b), inv_freq)
        sums[ctx.layer_idx] = sums.get(ctx.layer_idx, 0) + pre.sum(0)
        return exact_attention(query, key, value, scaling, attention_mask)

    device = next(model.parameters()).device
    with attention_override(model, fn):
        for chunk in chunks:
            check(chunk.numel() > sink, "chunk", f"longer than sink={sink}", chunk.numel())
            model.get_decoder()(input_ids=chunk[None].to(device), use_cache=False)
            count += chunk.numel() - sink
    n = len(sums) if layers is None else layers
    return [(sums[i] / count).float() for i in range(n)]


class RopeMeanScheme(KVScheme):
    """``oscar2`` with the key mean replaced by ``RoPE_p(m)`` (emulation only; see module doc).

    Rotations, clip ratios and values are the artifact's; the bits are the same as ``oscar2``.
    """

    def __init__(self, base: KVScheme, means: Sequence[torch.Tensor], inv_freq: torch.Tensor):
        self.name, self.description = "oscar2-ropemean", "oscar2 centred by the pre-RoPE key mean"
        self.base, self.means, self.inv_freq = base, list(means), inv_freq
        self._codecs: dict[int, RowCodec] = {}

    def _key_codec(self, layer_idx: int) -> RowCodec:
        if layer_idx not in self._codecs:
            c = self.base.key_codec(layer_idx)
            # keep everything but the static mean (rotation, clip, feedback)
            self._codecs[layer_idx] = dataclasses.replace(c, mean=None, rope_mean=None, rope_inv_freq=None)
        return self._codecs[layer_idx]

    def position_mean(self, layer_idx: int, length: int, device: torch.device) -> torch.Tensor:
        """``[length, H_kv, d]`` float32 ``RoPE_p(m)`` for positions ``0..length-1``."""
        m = self.means[layer_idx].double()[None].expand(length, *self.means[layer_idx].shape)
        return apply_rope(m, torch.arange(length), self.inv_freq).float().to(device)

    def fake_quantize_keys(self, layer_idx: int, k: torch.Tensor) -> torch.Tensor:
        return self.fake_quantize_keys_at(layer_idx, k, torch.arange(k.shape[0]))

    def fake_quantize_keys_at(self, layer_idx: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        m = self.means[layer_idx].double()[None].expand(k.shape[0], *self.means[layer_idx].shape)
        mu = apply_rope(m, positions, self.inv_freq).float().to(k.device)
        return (self._key_codec(layer_idx).fake_quantize(k.float() - mu) + mu).to(k.dtype)

    def fake_quantize_values(self, layer_idx: int, v: torch.Tensor) -> torch.Tensor:
        return self.base.fake_quantize_values(layer_idx, v)

    def bits_per_element(self, seq_len: int, head_dim: int, sink: int, recent: int) -> float:
        return self.base.bits_per_element(seq_len, head_dim, sink, recent)
