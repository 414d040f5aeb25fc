"""KV-cache quantisation schemes compared by the evaluation harness.

A scheme fake-quantises the keys and values of one layer in the ORIGINAL basis:
``k_hat = decode(encode(k))`` where a per-token scheme centres, rotates, quantises
to INT2, dequantises, un-rotates and adds the mean back. Rotating K and un-rotating
is mathematically the same as rotating the query once in serving
(``q · k_hat = (q R) · (R^T k_hat)``); adding the key mean back is the same as
leaving it out, because softmax ignores a constant added to all of one query's
logits — once every key, BF16 windows included, is centred the same way.

Which tokens are quantised (sink / recent windows) is not a scheme's business:
:mod:`oscar_calib.simulate` and :mod:`oscar_calib.cache` decide that, identically
for every scheme.

Built-in schemes register through the same pluggy hook as third-party ones
(``oscar_schemes``, entry point ``builtin_schemes = "oscar_calib.schemes"``):

========================  ==================================================================
``bf16``                  no quantisation (the reference)
``int2``                  per-token asymmetric min/max INT2, one group per row, no rotation
``kivi2``                 KIVI: keys per channel over 32-token blocks, values per token
``hadamard2``             seeded random-sign Hadamard rotation, per-token INT2
``oscar2``                calibrated rotations + key centering + the artifact's clip ratios as
                          stored (what engines serve: by default chosen by the output search,
                          :mod:`oscar_calib.output_clip`; with ``clip_search="row"`` the
                          tempered ``alpha ** p``)
``oscar2-calclip``        ``oscar2`` with the untempered searched ratios ``alpha`` (row-search
                          artifacts only: an output-search artifact records no power, so
                          this equals ``oscar2`` there)
``oscar2-noclip``         ``oscar2`` without clipping
``oscar2-nocenter``       ``oscar2`` without key centering
``oscar2-nobitrev``       ``oscar2`` without the bit-reversal permutation (group < d only)
``oscar2-norot``          ``oscar2`` with identity rotations (centering and clipping kept)
``oscar2-nofeedback``     ``oscar2`` with plain rounding where the artifact stores error-feedback
                          matrices (format version 2; :mod:`oscar_math.feedback`)
``hadamard2-center``      ``hadamard2`` with the calibrated key mean subtracted
``oscar2-kernels``        ``oscar2`` served through the paged INT2 kernels (needs
                          ``oscar-calib[kernels]``; registered by :mod:`oscar_calib.paged`
                          through the same hook, entry point ``kernels_scheme``)
========================  ==================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from oscar_math import Int2Quantized, check, dequantize_int2, fake_quantize_int2, quantize_int2
from oscar_math.feedback import quantize_int2_feedback
from oscar_math.hookspecs import hookimpl

__all__ = [
    "RowCodec",
    "KVScheme",
    "BF16Scheme",
    "RowInt2Scheme",
    "KiviScheme",
    "SchemeContext",
    "build_scheme",
    "scheme_names",
    "remove_bit_reversal",
    "oscar_schemes",
    "DEFAULT_SCHEMES",
    "QUANTIZED_BITS",
]

#: schemes evaluated when the user names none (``oscar eval`` / ``oscar demo``).
DEFAULT_SCHEMES = (
    "bf16",
    "int2",
    "kivi2",
    "hadamard2",
    "oscar2",
    "oscar2-calclip",
    "oscar2-noclip",
    "oscar2-nocenter",
    "oscar2-norot",
)

#: nominal code width of every quantised scheme here.
QUANTIZED_BITS = 2


def _per_head(t: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Broadcast a per-group tensor ``[G, ...]`` (G = 1 or num_heads) to ``[num_heads, ...]``."""
    if t is None:
        return None
    check(t.shape[0] in (1, num_heads), "rotation groups", f"1 or {num_heads}", t.shape[0])
    return t.expand(num_heads, *t.shape[1:]) if t.shape[0] == 1 else t


@dataclass(frozen=True)
class RowCodec:
    """Per-token INT2 codec for one layer's keys or values (the serving write path).

    Attributes:
        group_size: elements per INT2 group, a divisor of ``d``.
        rotation: ``[G, d, d]`` float32 orthogonal (G = 1 or H_kv), applied as
            ``x @ R``; None means identity.
        mean: ``[G, d]`` float32 subtracted (original basis) before rotating; None: none.
        clip: ``[G]`` clip ratios in ``(0, 1]``; None: no clipping.
        feedback: ``[G, d, d]`` strictly lower-triangular error-feedback matrices
            (:mod:`oscar_math.feedback`): codes are rounded in order with each error fed
            forward; None: plain rounding.
        refit_weight: *emulation only* (not in the artifact; measured worse, docs/results.md,
            fifth study): ``[G, d]`` weights of the least-squares scale/zero refit after the
            feedback codes (:func:`oscar_math.feedback.quantize_int2_feedback`); None: no refit.
        refit_passes: re-round + refit passes of that refit.
        rope_mean: ``[G, d]`` pre-RoPE key mean (artifact format version 3,
            :mod:`oscar_math.rope_center`): a row at position ``p`` is centred by
            ``mean + RoPE_p(rope_mean)`` before rotating and gets it back after; None: none.
        rope_inv_freq: ``[d/2]`` RoPE inverse frequencies (given with ``rope_mean``).

    Positions: the methods take ``positions`` ``[T]`` (int) for rows ``[..., T, H, d]`` (the
    token dim is third from last); ``None`` means ``0..T-1`` (the row's index in its sequence).
    Only ``rope_mean`` reads them.
    """

    group_size: int
    rotation: torch.Tensor | None = None
    mean: torch.Tensor | None = None
    clip: torch.Tensor | None = None
    feedback: torch.Tensor | None = None
    refit_weight: torch.Tensor | None = None
    refit_passes: int = 0
    rope_mean: torch.Tensor | None = None
    rope_inv_freq: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check(
            (self.rope_mean is None) == (self.rope_inv_freq is None),
            "rope_mean / rope_inv_freq",
            "both or neither",
            (self.rope_mean is not None, self.rope_inv_freq is not None),
        )

    def position_mean(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor | None:
        """``[T, H, d]`` float32 ``RoPE_p(rope_mean)`` for the rows ``x [..., T, H, d]`` (None
        without a pre-RoPE mean); broadcasts against ``x``."""
        if self.rope_mean is None:
            return None
        from oscar_math.rope_center import rope_position_mean

        t, h = x.shape[-3], x.shape[-2]
        pos = torch.arange(t) if positions is None else torch.as_tensor(positions).reshape(-1)
        check(pos.shape == (t,), "shape of positions", (t,), tuple(pos.shape))
        mean = _per_head(self.rope_mean, h).to(x.device)
        return rope_position_mean(mean, pos.to(x.device), self.rope_inv_freq.to(x.device))

    def to_rotated(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``[..., H, d]`` → centred, rotated ``[..., H, d]`` float32."""
        h = x.shape[-2]
        y = x.float()
        mean = _per_head(self.mean, h)
        if mean is not None:
            y = y - mean.to(y.device, torch.float32)
        pmean = self.position_mean(x, positions)
        if pmean is not None:
            y = y - pmean
        rot = _per_head(self.rotation, h)
        if rot is not None:
            y = torch.einsum("...hd,hde->...he", y, rot.to(y.device, torch.float32))
        return y

    def from_rotated(
        self, y: torch.Tensor, dtype: torch.dtype, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Inverse of :meth:`to_rotated`: ``[..., H, d]`` float32 → original basis in ``dtype``."""
        h = y.shape[-2]
        rot = _per_head(self.rotation, h)
        if rot is not None:
            y = torch.einsum("...he,hde->...hd", y, rot.to(y.device, torch.float32))
        mean = _per_head(self.mean, h)
        if mean is not None:
            y = y + mean.to(y.device, torch.float32)
        pmean = self.position_mean(y, positions)
        if pmean is not None:
            y = y + pmean
        return y.to(dtype)

    def clip_ratio(self, num_heads: int, device: torch.device) -> torch.Tensor | None:
        """``[H, 1]`` ratios for :func:`oscar_math.quantize_int2` on ``[T, H, d]`` rows."""
        clip = _per_head(self.clip, num_heads)
        return None if clip is None else clip.to(device, torch.float32).reshape(num_heads, 1)

    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> Int2Quantized:
        """``[..., H, d]`` rows → packed INT2 of the centred, rotated rows."""
        ratio = self.clip_ratio(x.shape[-2], x.device)
        if self.feedback is not None:
            fb = _per_head(self.feedback, x.shape[-2])
            rw = _per_head(self.refit_weight, x.shape[-2])
            return quantize_int2_feedback(
                self.to_rotated(x, positions),
                self.group_size,
                fb,
                ratio,
                refit_weight=rw,
                refit_passes=self.refit_passes,
            )
        return quantize_int2(self.to_rotated(x, positions), self.group_size, ratio)

    def decode(
        self, q: Int2Quantized, dtype: torch.dtype, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Packed ``[..., H, d/4]`` → ``[..., H, d]`` in the original basis."""
        return self.from_rotated(dequantize_int2(q), dtype, positions)

    def fake_quantize(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``decode(encode(x))`` without packing: ``[..., H, d]`` → same shape in ``x.dtype``."""
        if self.feedback is not None:
            return self.from_rotated(dequantize_int2(self.encode(x, positions)), x.dtype, positions)
        y = self.to_rotated(x, positions)
        yq = fake_quantize_int2(y, self.group_size, self.clip_ratio(x.shape[-2], x.device))
        return self.from_rotated(yq, x.dtype, positions)


class KVScheme:
    """Base class: a named way of storing the K/V cache.

    Subclasses implement :meth:`fake_quantize_keys` / :meth:`fake_quantize_values`
    on ``[T, H_kv, d]`` tensors of one layer and :meth:`bits_per_element`.
    ``key_codec`` / ``value_codec`` return a :class:`RowCodec` when the scheme is a
    per-token INT2 scheme that :class:`oscar_calib.cache.OscarCache` can store packed.
    """

    name: str = "?"
    description: str = ""
    quantized: bool = True

    def fake_quantize_keys(self, layer_idx: int, k: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fake_quantize_values(self, layer_idx: int, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def fake_quantize_keys_at(self, layer_idx: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys ``[T, H, d]`` at sequence positions ``positions [T]`` (not ``0..T-1``): what a
        cache that quantises a slice calls. Position-independent schemes ignore them."""
        return self.fake_quantize_keys(layer_idx, k)

    def key_codec(self, layer_idx: int) -> RowCodec | None:
        return None

    def value_codec(self, layer_idx: int) -> RowCodec | None:
        return None

    def bits_per_element(self, seq_len: int, head_dim: int, sink: int, recent: int) -> float:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class BF16Scheme(KVScheme):
    """No quantisation: the model's own K/V (16 bits per element when served in BF16)."""

    quantized = False

    def __init__(self, name: str = "bf16", description: str = "no quantisation (reference)"):
        self.name, self.description = name, description

    def fake_quantize_keys(self, layer_idx: int, k: torch.Tensor) -> torch.Tensor:
        return k

    def fake_quantize_values(self, layer_idx: int, v: torch.Tensor) -> torch.Tensor:
        return v

    def bits_per_element(self, seq_len: int, head_dim: int, sink: int, recent: int) -> float:
        return 16.0


class RowInt2Scheme(KVScheme):
    """Per-token INT2 with an optional per-layer rotation, key mean and clip ratio.

    ``key_codecs(layer_idx)`` / ``value_codecs(layer_idx)`` give each layer's
    :class:`RowCodec`; ``int2``, ``hadamard2`` and every ``oscar2*`` variant are this
    class with different codecs.
    """

    def __init__(
        self,
        name: str,
        description: str,
        group_size: int | None,
        key_codecs: Callable[[int], RowCodec],
        value_codecs: Callable[[int], RowCodec],
    ):
        self.name, self.description, self.group_size = name, description, group_size
        self._key_codecs, self._value_codecs = key_codecs, value_codecs
        self._cache: dict[tuple[str, int], RowCodec] = {}

    def _codec(self, kind: str, layer_idx: int) -> RowCodec:
        key = (kind, layer_idx)
        if key not in self._cache:
            fn = self._key_codecs if kind == "k" else self._value_codecs
            self._cache[key] = fn(layer_idx)
        return self._cache[key]

    def key_codec(self, layer_idx: int) -> RowCodec:
        return self._codec("k", layer_idx)

    def value_codec(self, layer_idx: int) -> RowCodec:
        return self._codec("v", layer_idx)

    def fake_quantize_keys(self, layer_idx: int, k: torch.Tensor) -> torch.Tensor:
        return self.key_codec(layer_idx).fake_quantize(k)

    def fake_quantize_keys_at(self, layer_idx: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.key_codec(layer_idx).fake_quantize(k, positions)

    def fake_quantize_values(self, layer_idx: int, v: torch.Tensor) -> torch.Tensor:
        return self.value_codec(layer_idx).fake_quantize(v)

    def bits_per_element(self, seq_len: int, head_dim: int, sink: int, recent: int) -> float:
        from oscar_math.bits import bits_per_element

        return bits_per_element(
            seq_len, head_dim, group_size=self.group_size, sink_tokens=sink, recent_tokens=recent
        )


class KiviScheme(KVScheme):
    """KIVI-style INT2: keys per channel over blocks of ``token_group`` tokens, values per token."""

    def __init__(self, name: str = "kivi2", token_group: int = 32, group_size: int | None = None):
        self.name, self.token_group, self.group_size = name, token_group, group_size
        self.description = f"KIVI: keys per channel over {token_group}-token blocks, values per token"

    def fake_quantize_keys(self, layer_idx: int, k: torch.Tensor) -> torch.Tensor:
        from oscar_math.kivi import kivi_fake_quantize_keys

        return kivi_fake_quantize_keys(k, self.token_group)

    def fake_quantize_values(self, layer_idx: int, v: torch.Tensor) -> torch.Tensor:
        from oscar_math.kivi import kivi_fake_quantize_values

        return kivi_fake_quantize_values(v, self.group_size)

    def bits_per_element(self, seq_len: int, head_dim: int, sink: int, recent: int) -> float:
        from oscar_math.bits import kivi_bits_per_element

        return kivi_bits_per_element(
            seq_len,
            head_dim,
            token_group=self.token_group,
            group_size=self.group_size,
            sink_tokens=sink,
            recent_tokens=recent,
        )


# ---------------------------------------------------------------------------------------------
# Built-in schemes, registered through the plugin hook.


@dataclass(frozen=True)
class SchemeContext:
    """What a scheme factory may use.

    Attributes:
        head_dim: ``d``.
        num_layers: decoder layers.
        num_kv_heads: ``H_kv``.
        rotations: an :class:`oscar_math.artifact.Rotations` or None (then only
            schemes that need no calibration can be built).
        group_size: INT2 group size for per-token schemes (None: the artifact's, else ``d``).
        seed: seed of random rotations (``hadamard2``).
    """

    head_dim: int
    num_layers: int
    num_kv_heads: int
    rotations: Any = None
    group_size: int | None = None
    seed: int = 0

    @property
    def effective_group_size(self) -> int:
        if self.group_size is not None:
            return self.group_size
        gs = getattr(self.rotations, "group_size", None) if self.rotations is not None else None
        return int(gs) if gs else self.head_dim


def _layer_tensor(rotations: Any, layer_idx: int, name: str) -> torch.Tensor | None:
    """``layers.{i}.{name}`` of an :class:`oscar_math.artifact.Rotations` (None if absent)."""
    value = getattr(rotations.for_layer(layer_idx), name, None)
    if value is None:
        return None
    return torch.as_tensor(value).float()


def _require_rotations(ctx: SchemeContext, name: str) -> Any:
    if ctx.rotations is None:
        from oscar_math import OscarError

        raise OscarError(f"Invalid rotations: expected a calibrated artifact for scheme {name!r}, got None")
    return ctx.rotations


def _make_int2(ctx: SchemeContext) -> KVScheme:
    gs = ctx.head_dim if ctx.group_size is None else ctx.group_size
    codec = RowCodec(gs)
    return RowInt2Scheme(
        "int2", f"per-token min/max INT2, group {gs}, no rotation", gs, lambda i: codec, lambda i: codec
    )


def _make_kivi(ctx: SchemeContext) -> KVScheme:
    return KiviScheme("kivi2", token_group=32, group_size=ctx.group_size)


def _hadamard(ctx: SchemeContext) -> torch.Tensor:
    from oscar_math.hadamard import random_sign_hadamard

    return random_sign_hadamard(ctx.head_dim, ctx.seed).float().unsqueeze(0)


def _make_hadamard(ctx: SchemeContext) -> KVScheme:
    gs = ctx.head_dim if ctx.group_size is None else ctx.group_size
    codec = RowCodec(gs, rotation=_hadamard(ctx))
    return RowInt2Scheme(
        "hadamard2",
        f"random-sign Hadamard (seed {ctx.seed}) + per-token INT2, group {gs}",
        gs,
        lambda i: codec,
        lambda i: codec,
    )


def _make_hadamard_center(ctx: SchemeContext) -> KVScheme:
    rot = _require_rotations(ctx, "hadamard2-center")
    gs = ctx.head_dim if ctx.group_size is None else ctx.group_size
    h = _hadamard(ctx)

    def k(i: int) -> RowCodec:
        # the pre-RoPE mean (format version 3) is part of the centering the artifact serves
        return RowCodec(gs, rotation=h, mean=_layer_tensor(rot, i, "k_mean"), **_rope_fields(rot, i))

    v = RowCodec(gs, rotation=h)
    return RowInt2Scheme(
        "hadamard2-center",
        "random-sign Hadamard + calibrated key mean subtracted, per-token INT2",
        gs,
        k,
        lambda i: v,
    )


def _rope_fields(rotations: Any, layer_idx: int) -> dict[str, torch.Tensor | None]:
    """``rope_mean`` / ``rope_inv_freq`` of layer ``layer_idx``'s key codec (format version 3),
    or Nones."""
    m = _layer_tensor(rotations, layer_idx, "k_rope_mean")
    f = getattr(rotations, "rope_inv_freq", None)
    if m is None or f is None:
        return {"rope_mean": None, "rope_inv_freq": None}
    return {"rope_mean": m, "rope_inv_freq": torch.as_tensor(f).float()}


def _stored_clip_power(rotations: Any, kind: str = "k", layer: int | None = None) -> float:
    """The artifact's ``clip_power`` for keys (``kind="k"``) or values (``"v"``: its
    ``value_clip_power`` if recorded, else ``clip_power``); stored ratio = searched ** power,
    1 if not recorded. Powers chosen per layer (``clip_power_per_layer``, written by
    :mod:`oscar_calib.power_search`) take precedence for ``layer``."""
    cal = getattr(rotations, "calibration", None) or {}
    cal = cal if isinstance(cal, dict) else {}
    per_layer = cal.get("clip_power_per_layer")
    if layer is not None and isinstance(per_layer, dict) and isinstance(per_layer.get(kind), list):
        powers = per_layer[kind]
        if 0 <= layer < len(powers) and isinstance(powers[layer], (int, float)) and powers[layer] > 0:
            return float(powers[layer])
    p = cal.get("clip_power", 1.0)
    if kind == "v":
        p = cal.get("value_clip_power", p)
    return float(p) if isinstance(p, (int, float)) and p > 0 else 1.0


def _clip_for(clip: torch.Tensor | None, power: float | None, stored_power: float) -> torch.Tensor | None:
    """Clip ratios for a scheme: ``power`` None = as stored (what engines serve); else the
    *searched* ratio ``** power`` (0 = no clipping, 1 = the raw search result)."""
    if clip is None or power == 0:
        return None
    if power is None or power == stored_power:
        return clip
    return clip.clamp(min=1e-6) ** (power / stored_power)


def _oscar_factory(
    name: str,
    description: str,
    *,
    clip_power: tuple[float | None, float | None] = (None, None),
    center: bool = True,
    rotate: bool = True,
    bit_reversal: bool = True,
    feedback: bool = True,
) -> Callable[[SchemeContext], KVScheme]:
    def make(ctx: SchemeContext) -> KVScheme:
        rot = _require_rotations(ctx, name)
        gs = ctx.effective_group_size

        def codec(kind: str, power: float | None) -> Callable[[int], RowCodec]:
            def build(i: int) -> RowCodec:
                r = _layer_tensor(rot, i, f"{kind}_rotation") if rotate else None
                if r is not None and not bit_reversal:
                    r = remove_bit_reversal(r, gs)
                return RowCodec(
                    gs,
                    rotation=r,
                    mean=_layer_tensor(rot, i, f"{kind}_mean") if center else None,
                    clip=_clip_for(
                        _layer_tensor(rot, i, f"{kind}_clip"), power, _stored_clip_power(rot, kind, i)
                    ),
                    # the artifact's error-feedback matrices (format version 2) are in the basis
                    # of the stored rotation: dropped with it (norot, nobitrev)
                    feedback=_layer_tensor(rot, i, f"{kind}_feedback")
                    if feedback and rotate and bit_reversal
                    else None,
                    # the pre-RoPE key mean (format version 3) is part of the key centering
                    **(_rope_fields(rot, i) if kind == "k" and center else {}),
                )

            return build

        return RowInt2Scheme(name, description, gs, codec("k", clip_power[0]), codec("v", clip_power[1]))

    return make


def _spec_type() -> Any:
    try:
        from oscar_math.hookspecs import SchemeSpec
    except ImportError:  # oscar-math without plugin support
        from collections import namedtuple

        return namedtuple("SchemeSpec", "name description factory")
    return SchemeSpec


def remove_bit_reversal(rotation: torch.Tensor, group_size: int) -> torch.Tensor:
    """``R = U · P_br · H_blk`` → ``U · H_blk`` (the same rotation without bit reversal).

    Undoes :func:`oscar_math.rotation.compose_rotation`'s permutation:
    ``U = R · H_blkᵀ · P_brᵀ``. Args: ``rotation`` ``[G, d, d]``. Returns float32.
    """
    from oscar_math.bitrev import bit_reversal_permutation, permutation_matrix
    from oscar_math.hadamard import block_hadamard

    d = rotation.shape[-1]
    h = block_hadamard(d, group_size)
    p = permutation_matrix(bit_reversal_permutation(d, group_size))
    return (rotation.double() @ h.T @ p.T @ h).float()


def _specs() -> list[Any]:
    SchemeSpec = _spec_type()

    return [
        SchemeSpec("bf16", "no quantisation (reference)", lambda ctx: BF16Scheme()),
        SchemeSpec("int2", "naive per-token min/max INT2, no rotation", _make_int2),
        SchemeSpec("kivi2", "KIVI: keys per channel (32-token blocks), values per token", _make_kivi),
        SchemeSpec("hadamard2", "seeded random-sign Hadamard + per-token INT2", _make_hadamard),
        SchemeSpec(
            "hadamard2-center", "Hadamard + calibrated key centering (ablation)", _make_hadamard_center
        ),
        SchemeSpec(
            "oscar2",
            "OSCAR: calibrated rotations + key centering + calibrated clipping, as stored in the artifact",
            _oscar_factory("oscar2", "calibrated rotation + key centering + stored clip (alpha**p)"),
        ),
        SchemeSpec(
            "oscar2-calclip",
            "oscar2 with the untempered searched clip ratios alpha (ablation)",
            _oscar_factory(
                "oscar2-calclip", "calibrated rotation + centering + clip alpha", clip_power=(1, 1)
            ),
        ),
        SchemeSpec(
            "oscar2-noclip",
            "oscar2 without clipping (ablation)",
            _oscar_factory(
                "oscar2-noclip", "calibrated rotation + key centering, no clip", clip_power=(0, 0)
            ),
        ),
        SchemeSpec(
            "oscar2-nocenter",
            "oscar2 without key centering (ablation)",
            _oscar_factory("oscar2-nocenter", "calibrated rotation + clip, no centering", center=False),
        ),
        SchemeSpec(
            "oscar2-nobitrev",
            "oscar2 without the bit-reversal permutation (matters at group < d; ablation)",
            _oscar_factory("oscar2-nobitrev", "oscar2 without bit reversal", bit_reversal=False),
        ),
        SchemeSpec(
            "oscar2-nofeedback",
            "oscar2 with plain rounding instead of the artifact's error-feedback codes (ablation)",
            _oscar_factory("oscar2-nofeedback", "oscar2 with plain rounding", feedback=False),
        ),
        SchemeSpec(
            "oscar2-norot",
            "oscar2 with identity rotations: centering + clipping only (ablation)",
            _oscar_factory("oscar2-norot", "key centering + clip, no rotation", rotate=False),
        ),
    ]


@hookimpl
def oscar_schemes() -> list[Any]:
    """Hook implementation: the built-in schemes (see the module docstring)."""
    return _specs()


def _all_specs() -> dict[str, Any]:
    from oscar_math.plugins import available_schemes

    specs = dict(available_schemes())
    if "bf16" not in specs:  # entry point not installed (e.g. a source checkout): add built-ins directly
        for spec in _specs():
            specs.setdefault(spec.name, spec)
    return specs


def scheme_names() -> list[str]:
    """Names of every registered scheme (built-in and plugins)."""
    return list(_all_specs())


def build_scheme(name: str, ctx: SchemeContext) -> KVScheme:
    """Build a registered scheme by name.

    Raises:
        OscarError: unknown name, or a calibrated scheme without rotations.
    """
    specs = _all_specs()
    check(name in specs, "scheme", f"one of {sorted(specs)}", repr(name))
    return specs[name].factory(ctx)
