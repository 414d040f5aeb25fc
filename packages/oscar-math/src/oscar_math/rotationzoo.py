"""Import rotations published for the reference OSCAR implementation ("RotationZoo").

The reference (github.com/FutureMLS-Lab/OSCAR, ``rotation/compute_kv_rotation.py``;
HF ``Zhongzhu/OSCAR-RotationZoo``) writes **two pickled ``.pt`` files per model**,
``k_rotation_qqt_r_h_pbr.pt`` and ``v_rotation_sst_r_h_pbr.pt``, each::

    {"format_version": 1, "objective": "qqt", "source_grouping": "layer",
     "layers": {layer_id: {"layer_id": layer_id,
                           "rotation": Tensor[d, d] | Tensor[H_kv, d, d],  # fp32, x_rot = x @ R
                           "eigenvalues": Tensor[d]}}}                      # optional

``layer_id`` is the global layer index (an ``int``, sometimes a ``str``; hybrid models
list only their attention layers). Per-head rotation sets store ``[H_kv, d, d]``.

We also accept, tolerantly: ``"layers"`` as a list; entries that are bare tensors; a
whole file that is one stacked tensor ``[L, d, d]`` / ``[L, H, d, d]`` or a list of
per-layer tensors; and a single combined file holding both K and V, either as
``{"k": <one of the above>, "v": ...}`` (also ``k_rotation`` / ``v_rotation``) or as
flat keys ``layers.{i}.k_rotation`` / ``layers.{i}.k_rot`` (and ``v_…``, optional
``…_eigenvalues``).

Files are read with ``torch.load(weights_only=True)`` only: tensors, dicts, lists,
strings and numbers load; any other pickled object is refused with
:class:`ArtifactError`. The reference has no calibrated clipping (it clamps at a
global per-row quantile at run time), so imported clip ratios are 1.0 and
``calibration`` says so; missing eigenvalues become zeros (unknown). Convert once
and ship the result as a safetensors artifact (:func:`oscar_math.save_rotations`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .artifact import DEFAULT_RECENT, DEFAULT_SINK, Rotations
from .errors import ArtifactError

__all__ = ["REFERENCE_K_FILE", "REFERENCE_V_FILE", "import_rotationzoo"]

#: file names the reference calibration pipeline writes and its server reads.
REFERENCE_K_FILE = "k_rotation_qqt_r_h_pbr.pt"
REFERENCE_V_FILE = "v_rotation_sst_r_h_pbr.pt"

_Entry = tuple[int, torch.Tensor, "torch.Tensor | None"]


def _load_pt(path: Path) -> Any:
    if not path.is_file():
        raise ArtifactError(f"{path}: RotationZoo file not found")
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError for forbidden objects, RuntimeError/EOFError for corrupt files
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ArtifactError(
            f"{path}: refused or unreadable .pt file (only tensors, dicts, lists, strings and numbers "
            f"are loaded, weights_only=True): {type(e).__name__}: {first}"
        ) from e


def _layer_id(key: Any, where: str) -> int:
    try:
        return int(key)
    except (TypeError, ValueError):
        raise ArtifactError(f"{where}: layer key {key!r} is not an integer layer id") from None


def _entry(lid: int, value: Any, where: str) -> _Entry:
    if isinstance(value, torch.Tensor):
        return lid, value, None
    if isinstance(value, Mapping):
        rot = next((value[k] for k in ("rotation", "R", "rot") if k in value), None)
        if not isinstance(rot, torch.Tensor):
            raise ArtifactError(
                f"{where}: layer {lid} has no 'rotation' tensor (keys: {sorted(map(str, value))})"
            )
        eig = value.get("eigenvalues", value.get("eigvals"))
        if eig is not None and not isinstance(eig, torch.Tensor):
            raise ArtifactError(f"{where}: layer {lid} 'eigenvalues' is not a tensor")
        return lid, rot, eig
    raise ArtifactError(f"{where}: layer {lid} is a {type(value).__name__}, expected a tensor or a dict")


def _parse_kind(obj: Any, where: str) -> tuple[list[_Entry], dict[str, Any]]:
    """One kind (K or V) in any accepted layout → entries sorted by layer id, and file info."""
    info: dict[str, Any] = {}
    layers = obj
    if isinstance(obj, Mapping) and "layers" in obj:
        for key in ("format_version", "objective", "source_grouping"):
            if key in obj and isinstance(obj[key], str | int | float):
                info[key] = obj[key]
        layers = obj["layers"]
    if isinstance(layers, torch.Tensor):
        if layers.dim() not in (3, 4):
            raise ArtifactError(
                f"{where}: stacked rotations must be [L, d, d] or [L, H, d, d], got {list(layers.shape)}"
            )
        entries = [(i, layers[i], None) for i in range(layers.shape[0])]
    elif isinstance(layers, Mapping):
        entries = [_entry(_layer_id(k, where), v, where) for k, v in layers.items()]
    elif isinstance(layers, Sequence) and not isinstance(layers, str):
        entries = [
            _entry(_layer_id(v.get("layer_id", i), where) if isinstance(v, Mapping) else i, v, where)
            for i, v in enumerate(layers)
        ]
    else:
        raise ArtifactError(f"{where}: unrecognised rotation layout ({type(obj).__name__})")
    if not entries:
        raise ArtifactError(f"{where}: no layers")
    entries.sort(key=lambda e: e[0])
    ids = [e[0] for e in entries]
    if len(set(ids)) != len(ids):
        raise ArtifactError(f"{where}: duplicate layer ids")
    return entries, info


def _split_combined(obj: Any, where: str) -> tuple[Any, Any] | None:
    """A single file holding K and V → (k_obj, v_obj), or None if it is a single-kind file."""
    if not isinstance(obj, Mapping) or "layers" in obj:
        return None
    for k_key, v_key in (("k", "v"), ("k_rotation", "v_rotation"), ("key", "value")):
        if k_key in obj and v_key in obj:
            return obj[k_key], obj[v_key]
    flat: dict[str, dict[int, dict[str, torch.Tensor]]] = {"k": {}, "v": {}}
    for name, value in obj.items():
        parts = str(name).split(".")
        if (
            len(parts) != 3
            or parts[0] != "layers"
            or not parts[1].isdigit()
            or parts[2][:2] not in ("k_", "v_")
        ):
            continue
        kind, field = parts[2][0], parts[2][2:]
        field = {
            "rot": "rotation",
            "rotation": "rotation",
            "eigenvalues": "eigenvalues",
            "eigvals": "eigenvalues",
        }.get(field)
        if field is not None and isinstance(value, torch.Tensor):
            flat[kind].setdefault(int(parts[1]), {})[field] = value
    if flat["k"] or flat["v"]:
        return {"layers": flat["k"]}, {"layers": flat["v"]}
    raise ArtifactError(
        f"{where}: unrecognised layout: expected a reference file with 'layers', a combined dict with "
        f"'k'/'v' entries, or 'layers.{{i}}.k_rotation' keys; top-level keys: {sorted(map(str, obj))[:8]}"
    )


def _find(directory: Path, prefix: str, reference: str) -> Path:
    if (directory / reference).is_file():
        return directory / reference
    found = sorted(directory.glob(f"{prefix}_rotation*.pt"))
    if len(found) != 1:
        raise ArtifactError(
            f"{directory}: expected one {prefix}_rotation*.pt file (e.g. {reference}), "
            f"found {[p.name for p in found]}"
        )
    return found[0]


def _to_groups(t: torch.Tensor, g: int, tail: tuple[int, ...], name: str) -> torch.Tensor:
    """``tail`` or ``[1, *tail]`` or ``[g, *tail]`` → ``[g, *tail]``."""
    if tuple(t.shape) == tail:
        t = t.unsqueeze(0)
    if t.dim() != len(tail) + 1 or tuple(t.shape[1:]) != tail or t.shape[0] not in (1, g):
        raise ArtifactError(
            f"Invalid shape of {name}: expected {list(tail)} or {[g, *tail]}, got {list(t.shape)}"
        )
    return t.float().expand(g, *tail)


def import_rotationzoo(
    path: str | os.PathLike,
    *,
    model: str,
    v_path: str | os.PathLike | None = None,
    num_kv_heads: int | None = None,
    group_size: int | None = None,
    sink_tokens: int = DEFAULT_SINK,
    recent_tokens: int = DEFAULT_RECENT,
) -> Rotations:
    """Convert reference OSCAR rotation files to :class:`Rotations` (validated).

    Args:
        path: a directory holding ``k_rotation*.pt`` and ``v_rotation*.pt`` (the
            reference names preferred); or the K file, with ``v_path`` the V file; or a
            single combined file (see the module docstring).
        model: model identifier to record.
        num_kv_heads: the model's KV head count; required when the files hold one
            rotation per layer (they do not say), checked against per-head files.
        group_size: quantisation group size (default ``head_dim``, the reference's 128).
        sink_tokens, recent_tokens: BF16 window sizes to record.
    Returns:
        :class:`Rotations` with granularity ``layer`` (``[d, d]`` per layer) or ``kv_head``
        (``[H, d, d]``), clip ratios 1.0, eigenvalues from the file or zeros.
    Raises:
        ArtifactError: unreadable or refused file, unknown layout, K/V disagreement,
            invalid rotations (non-orthogonal, NaN, ...).
    """
    p = Path(path)
    if v_path is not None:
        k_file, v_file = p, Path(v_path)
        k_obj, v_obj = _load_pt(k_file), _load_pt(v_file)
    elif p.is_dir():
        k_file, v_file = _find(p, "k", REFERENCE_K_FILE), _find(p, "v", REFERENCE_V_FILE)
        k_obj, v_obj = _load_pt(k_file), _load_pt(v_file)
    else:
        k_file = v_file = p
        pair = _split_combined(_load_pt(p), str(p))
        if pair is None:
            raise ArtifactError(f"{p}: holds one set of rotations (K or V); pass the other file as v_path")
        k_obj, v_obj = pair
    k_entries, k_info = _parse_kind(k_obj, str(k_file))
    v_entries, v_info = _parse_kind(v_obj, str(v_file))
    k_ids, v_ids = [e[0] for e in k_entries], [e[0] for e in v_entries]
    if k_ids != v_ids:
        raise ArtifactError(f"{k_file} / {v_file}: K and V cover different layers: {k_ids} vs {v_ids}")

    d = k_entries[0][1].shape[-1]
    shapes = {tuple(e[1].shape) for e in k_entries + v_entries}
    if any(len(s) not in (2, 3) or s[-1] != d or s[-2] != d for s in shapes):
        raise ArtifactError(
            f"{k_file}: rotations must be [d, d] or [H, d, d] with one d for K and V, got {sorted(shapes)}"
        )
    heads = {s[0] for s in shapes if len(s) == 3 and s[0] > 1}
    if len(heads) > 1:
        raise ArtifactError(f"{k_file}: per-head rotations disagree on the KV head count: {sorted(heads)}")
    if heads:
        (h,) = heads
        if num_kv_heads is not None and num_kv_heads != h:
            raise ArtifactError(
                f"{k_file}: num_kv_heads mismatch: expected {num_kv_heads}, the file has {h} heads"
            )
        num_kv_heads, granularity, g = h, "kv_head", h
    else:
        if num_kv_heads is None:
            raise ArtifactError(
                f"{k_file}: the file holds one rotation per layer and does not say how many KV heads "
                "the model has: pass num_kv_heads"
            )
        granularity, g = "layer", 1

    def build(entries: list[_Entry], kind: str) -> tuple[list[torch.Tensor], list[torch.Tensor], bool]:
        rots, eigs, have = [], [], True
        for lid, rot, eig in entries:
            rots.append(_to_groups(rot, g, (d, d), f"{kind} rotation of layer {lid}"))
            if eig is None:
                have = False
                eigs.append(torch.zeros(g, d))
            else:
                eigs.append(_to_groups(eig, g, (d,), f"{kind} eigenvalues of layer {lid}"))
        return rots, eigs, have

    k_rot, k_eig, k_have = build(k_entries, "K")
    v_rot, v_eig, v_have = build(v_entries, "V")
    n = len(k_entries)
    calibration: dict[str, Any] = {
        "source": "rotationzoo",
        "k_file": k_file.name,
        "v_file": v_file.name,
        "k_info": {k: v if isinstance(v, str | int | float) else str(v) for k, v in k_info.items()},
        "v_info": {k: v if isinstance(v, str | int | float) else str(v) for k, v in v_info.items()},
        "clip": "not calibrated: the reference clamps each row at run time at a global magnitude "
        "quantile (K 0.96, V 0.92); clip ratios set to 1.0",
        "eigenvalues": "from file" if (k_have and v_have) else "absent in file: zeros (unknown)",
    }
    if k_ids != list(range(n)):
        calibration["layer_ids"] = k_ids  # global ids of the attention layers, in artifact order
    try:
        return Rotations(
            model=model,
            num_layers=n,
            num_kv_heads=num_kv_heads,
            head_dim=d,
            group_size=d if group_size is None else group_size,
            sink_tokens=sink_tokens,
            recent_tokens=recent_tokens,
            granularity=granularity,
            k_rotation=k_rot,
            v_rotation=v_rot,
            k_eigenvalues=k_eig,
            v_eigenvalues=v_eig,
            k_clip=[torch.ones(g)] * n,
            v_clip=[torch.ones(g)] * n,
            calibration=calibration,
        )
    except ArtifactError as e:
        raise ArtifactError(f"{k_file}: {e}") from None
