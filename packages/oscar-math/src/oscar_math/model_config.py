"""Attention geometry read from a local model folder's ``config.json`` (no transformers import).

The engine launchers (``oscar serve``) check a rotations artifact against the model
before starting an engine; this is the one reader they share.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import OscarError

__all__ = ["model_geometry"]


def model_geometry(model: str) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` from ``MODEL/config.json``.

    Multimodal configs are read through their ``text_config``. Raises
    :class:`~oscar_math.errors.OscarError` (one line naming ``model``) when the folder
    has no readable config or the config lacks the attention geometry.
    """
    cfg_path = Path(model).expanduser() / "config.json"
    if not cfg_path.is_file():
        raise OscarError(f"model '{model}': no config.json there (oscar serve needs a local model folder)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise OscarError(f"model '{model}': unreadable config.json ({e})") from e
    cfg = cfg.get("text_config", cfg)
    try:
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        return int(cfg["num_hidden_layers"]), kv, head_dim
    except (KeyError, TypeError, ValueError) as e:
        raise OscarError(f"model '{model}': config.json lacks the attention geometry ({e})") from e
