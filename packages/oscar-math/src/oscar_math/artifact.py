"""The rotations artifact: one ``.safetensors`` file per model (docs/format.md).

Save, load and validate. Loading checks everything a serving engine relies on —
format and version, every metadata key, every tensor's presence, shape, dtype and
finiteness, orthogonality of every rotation, the clip-ratio range, and that the
file matches the model being served — and fails with an :class:`ArtifactError`
whose one-line message names the file and the problem. Never pickles.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from .errors import ArtifactError

#: BF16 windows every layout defaults to: the first ``DEFAULT_SINK`` tokens and the last
#: ``DEFAULT_RECENT`` before each query (docs/format.md, "Window rule")
DEFAULT_SINK, DEFAULT_RECENT = 64, 256

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "FORMAT_VERSION_FEEDBACK",
    "FORMAT_VERSION_ROPE",
    "FORMAT_VERSIONS",
    "ORTHOGONALITY_TOL",
    "Granularity",
    "LayerRotations",
    "Rotations",
    "identity_rotations",
    "save_rotations",
    "load_rotations",
]

#: value of the ``format`` metadata key.
FORMAT = "oscar-rotations"
#: ``format_version`` of a file without error-feedback matrices (what readers of version 1 accept).
FORMAT_VERSION = "1"
#: ``format_version`` of a file with ``k_feedback`` / ``v_feedback``: the codes depend on them, so a
#: reader that knows only version 1 must refuse the file rather than serve plain rounding.
FORMAT_VERSION_FEEDBACK = "2"
#: ``format_version`` of a file with a pre-RoPE key mean (``k_rope_mean`` + ``rope_inv_freq``,
#: :mod:`oscar_math.rope_center`): INT2 key rows are centred per position, so a reader of
#: versions 1/2 would serve wrong keys and must refuse it. Feedback matrices are optional in it.
FORMAT_VERSION_ROPE = "3"
#: every version this code reads.
FORMAT_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_FEEDBACK, FORMAT_VERSION_ROPE)
#: largest accepted ``max |RᵀR − I|`` of a stored rotation (float32 storage gives ~1e-6).
ORTHOGONALITY_TOL = 1e-3

_INT_KEYS = ("num_layers", "num_kv_heads", "head_dim", "group_size", "sink_tokens", "recent_tokens")
_META_KEYS = ("format", "format_version", "model", *_INT_KEYS, "granularity", "calibration")
#: per-layer tensors, in the order they are reported; ``k_mean`` is optional.
_KINDS = ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip")
_OPTIONAL = ("k_mean",)
#: optional error-feedback matrices (format version 2), each all layers or none.
_FEEDBACK = ("k_feedback", "v_feedback")
#: optional per-layer pre-RoPE key mean (format version 3), all layers or none, with the
#: top-level ``rope_inv_freq`` tensor.
_ROPE = ("k_rope_mean",)
_INV_FREQ = "rope_inv_freq"
_ALL_KINDS = (*_KINDS, *_OPTIONAL, *_FEEDBACK, *_ROPE)


class Granularity(str, Enum):
    """How many rotations (and clip ratios) a layer has: ``G = 1`` or ``G = num_kv_heads``."""

    LAYER = "layer"
    KV_HEAD = "kv_head"


@dataclass(frozen=True, eq=False)
class LayerRotations:
    """One layer's tensors (``G`` = 1 for ``layer`` granularity, ``num_kv_heads`` for ``kv_head``).

    Attributes:
        k_rotation, v_rotation: ``[G, d, d]`` float32, orthogonal; ``x_rot = x @ R``.
        k_eigenvalues, v_eigenvalues: ``[G, d]`` float32 (0 where unknown).
        k_clip, v_clip: ``[G]`` float32 clip ratios in ``(0, 1]``.
        k_mean: ``[G, d]`` float32 key mean in the original basis, or ``None``.
        k_feedback, v_feedback: ``[G, d, d]`` float32 strictly lower-triangular error-feedback
            matrices (:mod:`oscar_math.feedback`), or ``None`` (plain rounding).
        k_rope_mean: ``[G, d]`` float32 pre-RoPE key mean of the INT2 rows, zero outside the
            selected frequency pairs (:mod:`oscar_math.rope_center`), or ``None``.
    """

    k_rotation: torch.Tensor
    v_rotation: torch.Tensor
    k_eigenvalues: torch.Tensor
    v_eigenvalues: torch.Tensor
    k_clip: torch.Tensor
    v_clip: torch.Tensor
    k_mean: torch.Tensor | None
    k_feedback: torch.Tensor | None = None
    v_feedback: torch.Tensor | None = None
    k_rope_mean: torch.Tensor | None = None


def _fail(msg: str) -> None:
    raise ArtifactError(msg)


@dataclass(frozen=True, eq=False)
class Rotations:
    """A model's rotations, clip ratios and key means (the artifact in memory).

    Per-layer tensor fields are sequences of length ``num_layers`` (stored as tuples);
    floating tensors of any dtype are converted to contiguous CPU float32. The
    constructor validates everything and raises :class:`ArtifactError`; use
    :func:`dataclasses.replace` to derive a modified copy (validated again).

    Attributes:
        model: model identifier the rotations were calibrated on.
        num_layers, num_kv_heads, head_dim: the model's attention geometry.
        group_size: quantisation group size along the head dim (divides ``head_dim``).
        sink_tokens, recent_tokens: BF16 window sizes the calibration assumed.
        granularity: ``layer`` (``G = 1``) or ``kv_head`` (``G = num_kv_heads``).
        k_rotation, v_rotation: ``num_layers × [G, d, d]``.
        k_eigenvalues, v_eigenvalues: ``num_layers × [G, d]``.
        k_clip, v_clip: ``num_layers × [G]``.
        k_mean: ``num_layers × [G, d]`` or ``None``.
        k_feedback, v_feedback: ``num_layers × [G, d, d]`` strictly lower triangular, or
            ``None``; either one present makes the file format version 2.
        k_rope_mean: ``num_layers × [G, d]`` pre-RoPE key means (zero outside the selected
            frequency pairs), or ``None``; present makes the file format version 3. INT2 key
            rows of position ``p`` are stored as ``Q((k − k_mean − RoPE_p(m)) @ R_K)`` and
            dequantised ``+ RoPE_p(m) @ R_K`` (:mod:`oscar_math.rope_center`).
        rope_inv_freq: ``[d/2]`` float32 RoPE inverse frequencies (all positive), given iff
            ``k_rope_mean`` is.
        calibration: JSON-serialisable provenance (token count, text source, seed, tool version).
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    group_size: int
    sink_tokens: int
    recent_tokens: int
    granularity: Granularity
    k_rotation: tuple[torch.Tensor, ...]
    v_rotation: tuple[torch.Tensor, ...]
    k_eigenvalues: tuple[torch.Tensor, ...]
    v_eigenvalues: tuple[torch.Tensor, ...]
    k_clip: tuple[torch.Tensor, ...]
    v_clip: tuple[torch.Tensor, ...]
    k_mean: tuple[torch.Tensor, ...] | None = None
    calibration: dict[str, Any] = field(default_factory=dict)
    k_feedback: tuple[torch.Tensor, ...] | None = None
    v_feedback: tuple[torch.Tensor, ...] | None = None
    k_rope_mean: tuple[torch.Tensor, ...] | None = None
    rope_inv_freq: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            _fail(f"Invalid model: expected a non-empty string, got {self.model!r}")
        for key in _INT_KEYS:
            v = getattr(self, key)
            low = 0 if key in ("sink_tokens", "recent_tokens") else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                _fail(f"Invalid {key}: expected an integer >= {low}, got {v!r}")
        if self.head_dim % 4:
            _fail(f"Invalid head_dim: expected a multiple of 4 (INT2 packing), got {self.head_dim}")
        if self.head_dim % self.group_size:
            _fail(
                f"Invalid group_size: expected a divisor of head_dim {self.head_dim}, got {self.group_size}"
            )
        try:
            object.__setattr__(self, "granularity", Granularity(self.granularity))
        except ValueError:
            _fail(f"Invalid granularity: expected 'layer' or 'kv_head', got {self.granularity!r}")
        if not isinstance(self.calibration, dict):
            _fail(f"Invalid calibration: expected a dict, got {type(self.calibration).__name__}")
        try:
            json.dumps(self.calibration)
        except (TypeError, ValueError) as e:
            _fail(f"Invalid calibration: expected JSON-serialisable values ({e})")
        object.__setattr__(self, "calibration", dict(self.calibration))
        g, d = self.num_groups, self.head_dim
        shapes = {
            "k_rotation": (g, d, d),
            "v_rotation": (g, d, d),
            "k_eigenvalues": (g, d),
            "v_eigenvalues": (g, d),
            "k_clip": (g,),
            "v_clip": (g,),
            "k_mean": (g, d),
            "k_feedback": (g, d, d),
            "v_feedback": (g, d, d),
            "k_rope_mean": (g, d),
        }
        for kind in _ALL_KINDS:
            seq = getattr(self, kind)
            if seq is None and kind not in _KINDS:
                continue
            if isinstance(seq, torch.Tensor) or not hasattr(seq, "__len__"):
                got = type(seq).__name__
                _fail(f"Invalid {kind}: expected a sequence of {self.num_layers} tensors, got {got}")
            if len(seq) != self.num_layers:
                _fail(f"Invalid {kind}: expected {self.num_layers} layers (num_layers), got {len(seq)}")
            out = []
            for i, t in enumerate(seq):
                name = f"layers.{i}.{kind}"
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    got = getattr(t, "dtype", type(t).__name__)
                    _fail(f"Invalid {name}: expected a floating tensor, got {got}")
                if tuple(t.shape) != shapes[kind]:
                    _fail(f"Invalid shape of {name}: expected {list(shapes[kind])}, got {list(t.shape)}")
                # own copy: callers may mutate theirs, and shared storage cannot be saved
                t = t.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
                if not bool(torch.isfinite(t).all()):
                    _fail(f"Invalid {name}: contains NaN or Inf")
                if kind.endswith("_rotation"):
                    r = t.double()
                    err = (
                        (r.transpose(-1, -2) @ r - torch.eye(d, dtype=torch.float64, device=r.device))
                        .abs()
                        .amax(dim=(-1, -2))
                    )
                    worst = int(err.argmax())
                    if float(err[worst]) > ORTHOGONALITY_TOL:
                        _fail(
                            f"Invalid {name}: not orthogonal, max |RᵀR - I| = {float(err[worst]):.3g} "
                            f"> {ORTHOGONALITY_TOL:g} (group {worst})"
                        )
                if kind.endswith("_feedback") and bool(torch.triu(t).ne(0).any()):
                    _fail(
                        f"Invalid {name}: expected a strictly lower-triangular matrix "
                        "(zero diagonal and above)"
                    )
                if kind.endswith("_clip") and not bool(((t > 0) & (t <= 1)).all()):
                    _fail(f"Invalid {name}: expected clip ratios in (0, 1], got {t.tolist()}")
                out.append(t)
            object.__setattr__(self, kind, tuple(out))
        self._check_rope()

    def _check_rope(self) -> None:
        f = self.rope_inv_freq
        if (self.k_rope_mean is None) != (f is None):
            have, lack = ("k_rope_mean", _INV_FREQ) if f is None else (_INV_FREQ, "k_rope_mean")
            _fail(f"Invalid {have}: given without {lack} (format version 3 needs both)")
        if f is None:
            return
        half = self.head_dim // 2
        if not isinstance(f, torch.Tensor) or not f.is_floating_point():
            got = getattr(f, "dtype", type(f).__name__)
            _fail(f"Invalid {_INV_FREQ}: expected a floating tensor, got {got}")
        if tuple(f.shape) != (half,):
            _fail(f"Invalid shape of {_INV_FREQ}: expected [{half}] (head_dim / 2), got {list(f.shape)}")
        f = f.detach().to(device="cpu", dtype=torch.float32, copy=True).contiguous()
        if not bool((torch.isfinite(f) & (f > 0)).all()):
            _fail(f"Invalid {_INV_FREQ}: expected finite positive frequencies, got {f.tolist()[:4]}...")
        object.__setattr__(self, "rope_inv_freq", f)

    @property
    def num_groups(self) -> int:
        """``G``: 1 for ``layer`` granularity, ``num_kv_heads`` for ``kv_head``."""
        return 1 if self.granularity == Granularity.LAYER else self.num_kv_heads

    def for_layer(self, i: int) -> LayerRotations:
        """Layer ``i``'s tensors (``0 <= i < num_layers``)."""
        if not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise ArtifactError(f"Invalid layer index: expected 0..{self.num_layers - 1}, got {i!r}")
        return LayerRotations(
            k_rotation=self.k_rotation[i],
            v_rotation=self.v_rotation[i],
            k_eigenvalues=self.k_eigenvalues[i],
            v_eigenvalues=self.v_eigenvalues[i],
            k_clip=self.k_clip[i],
            v_clip=self.v_clip[i],
            k_mean=None if self.k_mean is None else self.k_mean[i],
            k_feedback=None if self.k_feedback is None else self.k_feedback[i],
            v_feedback=None if self.v_feedback is None else self.v_feedback[i],
            k_rope_mean=None if self.k_rope_mean is None else self.k_rope_mean[i],
        )

    @property
    def has_feedback(self) -> bool:
        """Whether the codes are written with error feedback (format version 2)."""
        return self.k_feedback is not None or self.v_feedback is not None

    @property
    def has_rope_mean(self) -> bool:
        """Whether INT2 key rows are centred by a pre-RoPE mean (format version 3)."""
        return self.k_rope_mean is not None

    @property
    def format_version(self) -> str:
        """``"3"`` with a pre-RoPE key mean, else ``"2"`` with error-feedback matrices, else
        ``"1"`` (the lowest version that can hold the file, so older readers still read it)."""
        if self.has_rope_mean:
            return FORMAT_VERSION_ROPE
        return FORMAT_VERSION_FEEDBACK if self.has_feedback else FORMAT_VERSION

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` strings of the file."""
        meta = {"format": FORMAT, "format_version": self.format_version, "model": self.model}
        meta.update({k: str(getattr(self, k)) for k in _INT_KEYS})
        meta["granularity"] = self.granularity.value
        meta["calibration"] = json.dumps(self.calibration, sort_keys=True)
        return meta

    def tensors(self) -> dict[str, torch.Tensor]:
        """The file's tensors by name, ``layers.{i}.{kind}`` (and the top-level ``rope_inv_freq``)."""
        out: dict[str, torch.Tensor] = {}
        for i in range(self.num_layers):
            for kind in _ALL_KINDS:
                seq = getattr(self, kind)
                if seq is not None:
                    out[f"layers.{i}.{kind}"] = seq[i]
        if self.rope_inv_freq is not None:
            out[_INV_FREQ] = self.rope_inv_freq
        return out


def identity_rotations(
    model: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    group_size: int | None = None,
    sink_tokens: int = DEFAULT_SINK,
    recent_tokens: int = DEFAULT_RECENT,
    granularity: str | Granularity = Granularity.LAYER,
    k_clip: float = 1.0,
    v_clip: float = 1.0,
    calibration: dict[str, Any] | None = None,
) -> Rotations:
    """Identity rotations, zero eigenvalues (unknown), constant clip ratios, no key mean.

    The "no rotation" baseline, and a well-formed file for tests.
    """
    g = 1 if Granularity(granularity) == Granularity.LAYER else num_kv_heads
    eye = torch.eye(head_dim).expand(g, head_dim, head_dim)
    zeros = torch.zeros(g, head_dim)
    n = num_layers
    return Rotations(
        model=model,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        group_size=head_dim if group_size is None else group_size,
        sink_tokens=sink_tokens,
        recent_tokens=recent_tokens,
        granularity=granularity,
        k_rotation=[eye] * n,
        v_rotation=[eye] * n,
        k_eigenvalues=[zeros] * n,
        v_eigenvalues=[zeros] * n,
        k_clip=[torch.full((g,), float(k_clip))] * n,
        v_clip=[torch.full((g,), float(v_clip))] * n,
        calibration={"source": "identity"} if calibration is None else calibration,
    )


def save_rotations(path: str | os.PathLike, rot: Rotations) -> Path:
    """Write ``rot`` to ``path`` (one ``.safetensors`` file, written atomically). Returns the path."""
    from safetensors.torch import save_file

    if not isinstance(rot, Rotations):
        raise ArtifactError(f"Invalid rot: expected Rotations, got {type(rot).__name__}")
    p = Path(path)
    if p.is_dir():  # checked first: os.replace would name the temporary file instead
        raise ArtifactError(f"Invalid path: expected a file name, got the folder '{path}'")
    p.parent.mkdir(parents=True, exist_ok=True)
    # write beside the target, then rename: a crash never leaves a half-written artifact
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        save_file(rot.tensors(), tmp, metadata=rot.metadata())
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return p


def _layer_kind_order(name: str) -> tuple[int, int, str]:
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit():
        kinds = _ALL_KINDS
        return (int(parts[1]), kinds.index(parts[2]) if parts[2] in kinds else 99, name)
    return (1 << 30, 0, name)


def _names_list(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def _read(p: Path) -> Rotations:
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="pt", device="cpu") as f:
            meta = f.metadata()
            names = list(f.keys())
            raw = {n: f.get_tensor(n) for n in names}
    except Exception as e:  # safetensors raises several types for corrupt input
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ArtifactError(f"not a readable safetensors file (truncated or corrupt?): {first}") from e
    if not meta:
        _fail("missing __metadata__: not an OSCAR rotations file")
    if meta.get("format") != FORMAT:
        _fail(f"Invalid format: expected {FORMAT!r}, got {meta.get('format')!r}")
    if "format_version" not in meta:
        _fail("missing metadata key 'format_version'")
    version = meta["format_version"]
    if version not in FORMAT_VERSIONS:
        _fail(f"Unsupported format_version: expected one of {list(FORMAT_VERSIONS)}, got {version!r}")
    for key in _META_KEYS:
        if key not in meta:
            _fail(f"missing metadata key {key!r}")
    ints = {}
    for key in _INT_KEYS:
        try:
            ints[key] = int(meta[key])
        except ValueError:
            _fail(f"Invalid metadata {key}: expected an integer, got {meta[key]!r}")
    try:
        calibration = json.loads(meta["calibration"])
    except json.JSONDecodeError as e:
        raise ArtifactError(f"Invalid metadata calibration: expected JSON ({e})") from None
    if not isinstance(calibration, dict):
        _fail(f"Invalid metadata calibration: expected a JSON object, got {type(calibration).__name__}")

    n = ints["num_layers"]
    if n < 1:
        _fail(f"Invalid num_layers: expected an integer >= 1, got {n}")
    required = [f"layers.{i}.{k}" for i in range(n) for k in _KINDS]
    optional = [f"layers.{i}.{k}" for i in range(n) for k in _OPTIONAL]
    if version in (FORMAT_VERSION_FEEDBACK, FORMAT_VERSION_ROPE):
        optional += [f"layers.{i}.{k}" for i in range(n) for k in _FEEDBACK]
    if version == FORMAT_VERSION_ROPE:
        optional += [f"layers.{i}.{k}" for i in range(n) for k in _ROPE] + [_INV_FREQ]
    present = set(names)
    missing = [x for x in required if x not in present]
    if missing:
        _fail(
            f"missing tensor {missing[0]}" + (f" ({len(missing)} missing in all)" if len(missing) > 1 else "")
        )
    unexpected = sorted(present - set(required) - set(optional), key=_layer_kind_order)
    if unexpected:
        _fail(f"unexpected tensors for num_layers={n}: {_names_list(unexpected)}")
    means = [f"layers.{i}.k_mean" for i in range(n)]
    has_mean = [x for x in means if x in present]
    if has_mean and len(has_mean) != n:
        first = next(x for x in means if x not in present)
        _fail(f"missing tensor {first} (k_mean is present for other layers)")
    feedback: dict[str, list[torch.Tensor] | None] = {}
    for kind in _FEEDBACK:
        have = [i for i in range(n) if f"layers.{i}.{kind}" in present]
        if have and len(have) != n:
            first = next(i for i in range(n) if i not in have)
            _fail(f"missing tensor layers.{first}.{kind} ({kind} is present for other layers)")
        feedback[kind] = [raw[f"layers.{i}.{kind}"] for i in range(n)] if have else None
    if version == FORMAT_VERSION_FEEDBACK and not any(v is not None for v in feedback.values()):
        _fail("format_version '2' without k_feedback or v_feedback tensors (version 1 is the format without)")
    rope: dict[str, Any] = {"k_rope_mean": None, "rope_inv_freq": None}
    if version == FORMAT_VERSION_ROPE:
        have = [i for i in range(n) if f"layers.{i}.k_rope_mean" in present]
        if len(have) != n:
            first = next(i for i in range(n) if i not in have)
            _fail(f"missing tensor layers.{first}.k_rope_mean (format_version '3' needs it for every layer)")
        if _INV_FREQ not in present:
            _fail(f"missing tensor {_INV_FREQ} (format_version '3' needs it with k_rope_mean)")
        rope = {"k_rope_mean": [raw[f"layers.{i}.k_rope_mean"] for i in range(n)], _INV_FREQ: raw[_INV_FREQ]}
    for name in sorted(names, key=_layer_kind_order):
        if raw[name].dtype != torch.float32:
            _fail(f"Invalid dtype of {name}: expected torch.float32, got {raw[name].dtype}")
    per_kind = {k: [raw[f"layers.{i}.{k}"] for i in range(n)] for k in _KINDS}
    return Rotations(
        model=meta["model"],
        granularity=meta["granularity"],
        calibration=calibration,
        k_mean=[raw[f"layers.{i}.k_mean"] for i in range(n)] if has_mean else None,
        **feedback,
        **rope,
        **ints,
        **per_kind,
    )


def load_rotations(
    path: str | os.PathLike,
    *,
    model: str | None = None,
    num_layers: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
) -> Rotations:
    """Load and validate an artifact; optionally check it matches the model being served.

    Args:
        path: the ``.safetensors`` file.
        model, num_layers, num_kv_heads, head_dim: what the caller expects; ``None`` skips.
    Returns:
        :class:`Rotations`.
    Raises:
        ArtifactError: ``"<path>: <problem>"`` for a missing, unreadable, truncated or
            malformed file, or one that does not match the expectations.
    """
    p = Path(path)
    if not p.exists():
        raise ArtifactError(f"{p}: rotations file not found")
    if not p.is_file():
        raise ArtifactError(f"{p}: not a regular file")
    try:
        # an artifact is host data: engines build models under a CUDA default device
        # (vLLM does), where a bare torch.eye/zeros would land beside CPU tensors
        with torch.device("cpu"):
            rot = _read(p)
    except ArtifactError as e:
        raise ArtifactError(f"{p}: {e}") from e.__cause__
    for key, want in (
        ("model", model),
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        got = getattr(rot, key)
        if want is not None and got != want:
            raise ArtifactError(
                f"{p}: {key} mismatch: the model being served has {want!r}, the file has {got!r}"
            )
    return rot
