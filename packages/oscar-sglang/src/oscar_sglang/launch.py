"""``oscar serve --engine sglang MODEL --rotations FILE [SGLang args]`` (the EngineSpec launcher).

Checks the artifact against the model's config first (one-line :class:`OscarError`), then
runs ``python -m sglang.launch_server --model-path MODEL --attention-backend oscar
--oscar-rotations FILE [args]`` with ``$OSCAR_ROTATIONS`` set as well (the scheduler
subprocesses inherit it). Does not import SGLang itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from oscar_math.artifact import load_rotations
from oscar_math.errors import OscarError

from .core import BACKEND_NAME, ENV_ROTATIONS, check_geometry

__all__ = ["launch", "model_geometry", "server_command"]


def model_geometry(model: str) -> tuple[int, int, int]:
    """``(num_layers, num_kv_heads, head_dim)`` from ``MODEL/config.json`` (a local model folder)."""
    cfg_path = Path(model) / "config.json"
    if not cfg_path.is_file():
        raise OscarError(
            f"{model}: no config.json (oscar serve needs a local model folder to check the rotations)"
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise OscarError(f"{cfg_path}: unreadable model config ({e})") from e
    cfg = cfg.get("text_config", cfg)
    try:
        heads = int(cfg["num_attention_heads"])
        kv = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        return int(cfg["num_hidden_layers"]), kv, head_dim
    except (KeyError, TypeError, ValueError) as e:
        raise OscarError(f"{cfg_path}: missing attention geometry ({e})") from e


def server_command(model: str, rotations: str, engine_args: list[str]) -> list[str]:
    """The SGLang command line ``oscar serve`` runs."""
    for i, a in enumerate(engine_args):
        chosen = a.split("=", 1)[1] if a.startswith("--attention-backend=") else None
        if a == "--attention-backend" and i + 1 < len(engine_args):
            chosen = engine_args[i + 1]
        if chosen is not None and chosen != BACKEND_NAME:
            raise OscarError(
                f"--attention-backend {chosen}: oscar serve runs SGLang with "
                f"--attention-backend {BACKEND_NAME}"
            )
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model]
    if not any(a == "--attention-backend" or a.startswith("--attention-backend=") for a in engine_args):
        cmd += ["--attention-backend", BACKEND_NAME]
    cmd += ["--oscar-rotations", str(Path(rotations).resolve())]
    if "--disable-cuda-graph" not in engine_args:
        cmd.append("--disable-cuda-graph")  # the backend has no CUDA-graph path yet
    return cmd + list(engine_args)


def launch(model: str, rotations: str, engine_args: list[str]) -> int:
    """Validate, then run SGLang's server in the foreground; returns its exit status."""
    layers, kv_heads, head_dim = model_geometry(model)
    check_geometry(head_dim, None)
    load_rotations(rotations, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    cmd = server_command(model, rotations, engine_args)
    env = {**os.environ, ENV_ROTATIONS: str(Path(rotations).resolve())}
    return subprocess.call(cmd, env=env)
