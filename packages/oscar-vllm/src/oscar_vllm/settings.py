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
  ``auto``: ``transient`` with vLLM's V2 model runner (a request's slot is its persistent row
  and is never lost), ``held`` with the V1 runner (slots follow content there).

Everything here is plain Python (no vLLM import) so it is unit-tested without vLLM.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from oscar_math.artifact import Rotations, load_rotations
from oscar_math.errors import OscarError

__all__ = [
    "cell_bytes",
    "OscarSettings",
    "settings_from",
    "check_excluded",
    "load_checked",
    "shard_kv_heads",
    "check_head_dim",
    "window_bytes_per_slot",
    "default_max_num_seqs",
]

ENV_ROTATIONS = "OSCAR_ROTATIONS"
#: values of ``additional_config["oscar"]["window_records"]``
WINDOW_RECORDS = ("auto", "transient", "held")


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


def cell_bytes(head_dim: int, group: int) -> int:
    """Bytes of one (KV head, token) cell of a page: K+V codes ``2·d/4``, K/V scale+zero ``4·2·d/group``."""
    return head_dim // 2 + 8 * (head_dim // group)


def check_head_dim(head_dim: int) -> None:
    """The kernels' head-dim rule (a multiple of 16), as a start-up error."""
    if head_dim < 16 or head_dim % 16:
        raise OscarError(
            f"the OSCAR kernels need a head dim that is a multiple of 16; this model has head dim {head_dim}"
        )


#: share of the device's memory that OSCAR's default ``max_num_seqs`` lets the BF16 windows take
WINDOW_MEMORY_SHARE = 0.04
#: OSCAR's default never goes below this many sequences (or the engine's own default)
MIN_DEFAULT_SEQS = 16


def window_bytes_per_slot(int2_layers: int, kv_heads: int, head_dim: int, sink: int, recent: int) -> int:
    """Bytes of one sequence slot's BF16 windows (K and V, sink + recent rows, every INT2 layer)."""
    return int2_layers * kv_heads * (sink + recent) * 2 * head_dim * 2


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


@functools.lru_cache(maxsize=4)
def _load(path: str, num_layers: int, num_kv_heads: int, head_dim: int) -> Rotations:
    return load_rotations(path, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)


def load_checked(settings: OscarSettings, num_layers: int, num_kv_heads: int, head_dim: int) -> Rotations:
    """Load the artifact once per process and check it against the model's geometry.

    Args:
        num_layers, num_kv_heads, head_dim: the model's (total, unsharded) values.
    Raises:
        OscarError: one line naming the file and the problem (missing, corrupt, other model).
    """
    check_head_dim(head_dim)
    check_excluded(settings.exclude_layers, num_layers)
    return _load(settings.rotations, num_layers, num_kv_heads, head_dim)


def shard_kv_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> list[int]:
    """The model's KV heads that tensor-parallel rank ``tp_rank`` holds, in order.

    vLLM splits KV heads evenly when ``total >= tp_size`` (rank ``r`` holds
    ``[r·n, (r+1)·n)``, ``n = total/tp``) and replicates them otherwise (rank ``r`` holds
    head ``r // (tp / total)``).
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise OscarError(f"Invalid tensor-parallel rank {tp_rank} of {tp_size}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise OscarError(f"{total_kv_heads} KV heads do not split over tensor-parallel size {tp_size}")
        n = total_kv_heads // tp_size
        return list(range(tp_rank * n, (tp_rank + 1) * n))
    if tp_size % total_kv_heads:
        raise OscarError(f"tensor-parallel size {tp_size} is not a multiple of {total_kv_heads} KV heads")
    return [tp_rank // (tp_size // total_kv_heads)]


def shard_params(params: Any, heads: list[int]) -> Any:
    """The :class:`oscar_kernels.LayerQuantParams` of a rank's KV heads.

    ``kv_head`` granularity takes the rank's rows of every per-head tensor; ``layer``
    granularity (one rotation per layer) applies to every head unchanged. Every field is
    sharded by name, and an unknown field is refused: a field added to the parameters
    (e.g. the error-feedback matrices of format version 2) must never reach a rank unsharded
    or be dropped, or the rank would serve something other than what ``oscar eval`` measured.
    """
    from dataclasses import fields, replace

    if params.granularity == "layer":
        return params
    idx = torch.tensor(heads, dtype=torch.long)
    # per-head rank of each field: [H, d, d] matrices, [H, d] mean, [H] clip ratios
    per_head_dims = {
        "k_rotation": 3,
        "v_rotation": 3,
        "k_feedback": 3,
        "v_feedback": 3,
        "k_mean": 2,
        "k_rope_mean": 2,  # pre-RoPE key mean of the INT2 rows (format version 3)
        "k_clip": 1,
        "v_clip": 1,
    }
    shared = {"k_rope_inv_freq"}  # the model's RoPE frequencies: the same for every head
    unknown = [f.name for f in fields(params) if f.name not in per_head_dims and f.name not in shared]
    if unknown:
        raise OscarError(f"oscar-vllm cannot shard the layer parameters {unknown}; upgrade oscar-vllm")

    def take(t: Any, dims: int) -> Any:
        # a shared value (float, [1] clip, [d, d] matrix) applies to every head unchanged
        if isinstance(t, torch.Tensor) and t.dim() == dims and t.shape[0] > 1:
            return t.index_select(0, idx.to(t.device))
        return t

    return replace(params, **{n: take(getattr(params, n), dims) for n, dims in per_head_dims.items()})
