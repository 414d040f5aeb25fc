"""``oscar serve --engine sglang MODEL --rotations FILE [SGLang args]`` (the EngineSpec launcher).

Checks the installed SGLang release (its package metadata) and the artifact against the model's
config first (one-line :class:`OscarError`), then runs ``python -m sglang.launch_server
--model-path MODEL --attention-backend oscar --oscar-rotations FILE [args]`` with
``$OSCAR_ROTATIONS`` set as well (the scheduler subprocesses inherit it). SGLang's CUDA graphs
stay as the user sets them (``--disable-cuda-graph`` is passed through, never added). Does not
import SGLang itself.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

from oscar_math.artifact import load_rotations
from oscar_math.errors import OscarError
from oscar_math.model_config import model_geometry

from .compat import check_release
from .core import BACKEND_NAME, ENV_ROTATIONS, check_geometry

__all__ = ["launch", "model_geometry", "server_command"]


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
    return cmd + list(engine_args)


def installed_sglang() -> str | None:
    """The installed SGLang's version from its package metadata (SGLang itself is not imported)."""
    try:
        return md.version("sglang")
    except md.PackageNotFoundError:
        return None


def launch(model: str, rotations: str, engine_args: list[str]) -> int:
    """Validate, then run SGLang's server in the foreground; returns its exit status."""
    check_release(installed_sglang())
    layers, kv_heads, head_dim = model_geometry(model)
    check_geometry(head_dim, None)
    load_rotations(rotations, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim)
    cmd = server_command(model, rotations, engine_args)
    env = {**os.environ, ENV_ROTATIONS: str(Path(rotations).resolve())}
    return subprocess.call(cmd, env=env)
