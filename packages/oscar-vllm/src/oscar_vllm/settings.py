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

The options themselves (every key, its type, default and environment fallback) are the
engine-neutral :class:`oscar_kernels.serving.settings.ServingSettings`; this module reads them
from vLLM's config. Everything here is plain Python (no vLLM import), unit-tested without vLLM.
What every engine shares (artifact loading, KV-head sharding, head-dim rule, page and window bytes) is in
:mod:`oscar_kernels.serving`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from oscar_kernels.serving import default_max_seqs, load_for_serving
from oscar_kernels.serving.settings import ServingSettings, WindowRecords
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

#: values of ``additional_config["oscar"]["window_records"]``
WINDOW_RECORDS = tuple(w.value for w in WindowRecords)
#: KV block (page) tokens of an OSCAR engine on a GPU when the user gives none (vLLM's default is
#: 16): the decode kernel's 64-token tiles and 16-byte copies need pages of 64 (compat.default_block_size)
GPU_BLOCK_SIZE = 64
_EXCLUDE = 'additional_config["oscar"]["exclude_layers"]'

#: OSCAR's options for one engine (the engine-neutral settings object)
OscarSettings = ServingSettings


def settings_from(
    additional_config: Any, env: Mapping[str, str] | None = None, require_rotations: bool = True
) -> ServingSettings:
    """The engine's :class:`~oscar_kernels.serving.settings.ServingSettings` from vLLM's
    ``additional_config`` (dict or ``None``) and the environment (``os.environ`` by default)."""
    extra = additional_config if isinstance(additional_config, dict) else {}
    section = extra.get("oscar", {})
    if not isinstance(section, dict):
        raise OscarError(f'additional_config["oscar"] must be a JSON object, got {type(section).__name__}')
    return ServingSettings.parse(
        section, os.environ if env is None else env, 'additional_config["oscar"]', require_rotations
    )


def check_excluded(exclude_layers: tuple[int, ...], num_layers: int) -> None:
    """Every excluded layer is a decoder layer of the model (no negative indices)."""
    bad = [i for i in exclude_layers if not 0 <= i < num_layers]
    if bad:
        raise OscarError(f"{_EXCLUDE} {bad}: not layers of this model (it has layers 0..{num_layers - 1})")


def default_max_num_seqs(engine_default: int, device_bytes: int, slot_bytes: int) -> int:
    """OSCAR's default ``max_num_seqs`` when the user set none (the engines' shared rule,
    :func:`oscar_kernels.serving.default_max_seqs`)."""
    return default_max_seqs(engine_default, device_bytes, slot_bytes)


def load_checked(settings: ServingSettings, num_layers: int, num_kv_heads: int, head_dim: int) -> Rotations:
    """Load the artifact once per process and check it against the model's geometry.

    Args:
        num_layers, num_kv_heads, head_dim: the model's (total, unsharded) values.
    Raises:
        OscarError: one line naming the file and the problem (missing, corrupt, other model).
    """
    check_excluded(settings.exclude_layers, num_layers)
    return load_for_serving(settings.rotations, num_layers, num_kv_heads, head_dim)
