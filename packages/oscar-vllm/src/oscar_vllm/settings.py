"""How the rotations artifact and OSCAR's options reach every vLLM worker.

Source of truth: vLLM's ``additional_config`` (``--additional-config '{"oscar": {...}}'``
or ``LLM(additional_config={"oscar": {...}})``), which vLLM ships inside its config to
every engine and worker process. Fallback: ``$OSCAR_ROTATIONS`` (a path), inherited by
worker processes from the launching environment.

Keys of ``additional_config["oscar"]``:

* ``rotations`` (str, required unless ``$OSCAR_ROTATIONS`` is set): the artifact.
* ``exclude_layers`` (list of int, optional): decoder layers (``0 .. num_layers-1``)
  that keep a plain BF16 KV cache and vLLM's own attention backend; every other layer
  is served in INT2. Artifacts always cover every layer (``oscar_math.artifact``
  requires ``layers.{i}.*`` for each ``i < num_layers``), so this list is the one way to
  keep layers in BF16.
* ``window_records`` (``"auto"``, ``"transient"`` or ``"held"``; default ``"auto"``): how long
  vLLM keeps the BF16 window records of a *running* request with prefix caching on
  (docs/vllm.md, "Prefix caching"). ``transient``: freed right after the step that wrote
  them (they stay cached, evictable, for later hits; ~5.4x BF16 capacity at 2k).
  ``held``: vLLM's sliding-window manager holds the last ``recent`` tokens' records for every
  running request (2.5x at 2k), so a request that loses its window slot can always restore.
  ``auto``: ``transient`` wherever a running request's slot is never lost: vLLM's V2 model runner
  (its persistent row) and the V1 runner (slots by request id, ``oscar_kernels.serving.RequestSlots``);
  ``held`` only where OSCAR cannot hook the V1 runner.

Everything here is plain Python (no vLLM import) so it is unit-tested without vLLM. What every
engine shares (artifact loading, KV-head sharding, head-dim rule, page and window bytes) is in
:mod:`oscar_kernels.serving`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from oscar_kernels.serving import load_for_serving
from oscar_math.artifact import Rotations
from oscar_math.errors import OscarError

__all__ = [
    "OscarSettings",
    "settings_from",
    "check_excluded",
    "load_checked",
    "default_max_num_seqs",
    "GPU_BLOCK_SIZE",
]

ENV_ROTATIONS = "OSCAR_ROTATIONS"
#: values of ``additional_config["oscar"]["window_records"]``
WINDOW_RECORDS = ("auto", "transient", "held")
#: KV block (page) tokens of an OSCAR engine on a GPU when the user gives none (vLLM's default is
#: 16): the decode kernel's 64-token tiles and 16-byte copies need pages of 64 (compat.default_block_size)
GPU_BLOCK_SIZE = 64


@dataclass(frozen=True)
class OscarSettings:
    """OSCAR's options for one engine."""

    rotations: str
    exclude_layers: tuple[int, ...] = ()
    window_records: str = "auto"


def settings_from(additional_config: Any) -> OscarSettings:
    """Read :class:`OscarSettings` from vLLM's ``additional_config`` (dict or ``None``), env fallback."""
    extra = additional_config if isinstance(additional_config, dict) else {}
    section = extra.get("oscar", {})
    if not isinstance(section, dict):
        raise OscarError(f'additional_config["oscar"] must be a JSON object, got {type(section).__name__}')
    unknown = sorted(set(section) - {"rotations", "exclude_layers", "window_records"})
    if unknown:
        raise OscarError(
            f'additional_config["oscar"] has unknown keys {unknown} '
            "(known: rotations, exclude_layers, window_records)"
        )
    records = section.get("window_records", "auto")
    if records not in WINDOW_RECORDS:
        raise OscarError(
            f'additional_config["oscar"]["window_records"] must be one of {list(WINDOW_RECORDS)}, '
            f"got {records!r}"
        )
    path = section.get("rotations") or os.environ.get(ENV_ROTATIONS, "")
    if not path:
        raise OscarError(
            "the OSCAR attention backend needs a rotations artifact: pass "
            '--additional-config \'{"oscar": {"rotations": "FILE"}}\' (or set OSCAR_ROTATIONS=FILE); '
            "make one with 'oscar calibrate MODEL --out FILE'"
        )
    return OscarSettings(
        rotations=str(path),
        exclude_layers=_exclude_list(section.get("exclude_layers", [])),
        window_records=records,
    )


_EXCLUDE = 'additional_config["oscar"]["exclude_layers"]'


def _exclude_list(value: Any) -> tuple[int, ...]:
    """The excluded layers, sorted; one-line errors for a non-list, non-ints and repeats."""
    # bool is an int subclass: `true` in JSON is a mistake, not layer 1
    if not isinstance(value, list | tuple) or not all(type(i) is int for i in value):
        raise OscarError(f"{_EXCLUDE} must be a list of layer indices (ints), got {value!r}")
    repeated = sorted({i for i in value if value.count(i) > 1})
    if repeated:
        raise OscarError(f"{_EXCLUDE} lists layers {repeated} more than once")
    return tuple(sorted(value))


def check_excluded(exclude_layers: tuple[int, ...], num_layers: int) -> None:
    """Every excluded layer is a decoder layer of the model (no negative indices)."""
    bad = [i for i in exclude_layers if not 0 <= i < num_layers]
    if bad:
        raise OscarError(f"{_EXCLUDE} {bad}: not layers of this model (it has layers 0..{num_layers - 1})")


#: share of the device's memory that OSCAR's default ``max_num_seqs`` lets the BF16 windows take
WINDOW_MEMORY_SHARE = 0.04
#: OSCAR's default never goes below this many sequences (or the engine's own default)
MIN_DEFAULT_SEQS = 16


def default_max_num_seqs(engine_default: int, device_bytes: int, slot_bytes: int) -> int:
    """OSCAR's default ``max_num_seqs`` when the user set none.

    Every sequence slot owns BF16 windows allocated up front (45 MiB at Qwen3-8B's shape), so
    vLLM's own GPU default (1024 slots on an H100/H200) would hand a third of the memory to
    windows that long requests never fill. The default is the number of slots whose windows
    take at most :data:`WINDOW_MEMORY_SHARE` of the device, within
    ``[min(MIN_DEFAULT_SEQS, engine_default), engine_default]``.
    """
    if device_bytes <= 0 or slot_bytes <= 0:
        return engine_default
    fit = int(WINDOW_MEMORY_SHARE * device_bytes) // slot_bytes
    return max(min(engine_default, fit), min(engine_default, MIN_DEFAULT_SEQS))


def load_checked(settings: OscarSettings, num_layers: int, num_kv_heads: int, head_dim: int) -> Rotations:
    """Load the artifact once per process and check it against the model's geometry.

    Args:
        num_layers, num_kv_heads, head_dim: the model's (total, unsharded) values.
    Raises:
        OscarError: one line naming the file and the problem (missing, corrupt, other model).
    """
    check_excluded(settings.exclude_layers, num_layers)
    return load_for_serving(settings.rotations, num_layers, num_kv_heads, head_dim)
