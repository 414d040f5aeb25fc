"""``oscar serve --engine vllm MODEL --rotations FILE [vLLM args...]``.

Checks the artifact against the model's ``config.json`` first (one-line
:class:`~oscar_math.errors.OscarError` on a mismatch), then runs ``vllm serve`` with the
OSCAR backend selected and the artifact passed through ``--additional-config``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from oscar_math.errors import OscarError
from oscar_math.model_config import model_geometry

from .settings import OscarSettings, load_checked

__all__ = ["model_geometry", "build_command", "serve"]


def build_command(model: str, rotations: str, engine_args: list[str]) -> list[str]:
    """The ``vllm serve`` command line (after checking the artifact against ``model``)."""
    for flag in ("--attention-backend", "--additional-config"):
        if any(a == flag or a.startswith(flag + "=") for a in engine_args):
            raise OscarError(f"oscar serve sets {flag} itself; remove it from the vLLM arguments")
    layers, kv, head_dim = model_geometry(model)
    path = str(Path(rotations).expanduser().resolve())
    load_checked(OscarSettings(rotations=path), layers, kv, head_dim)
    exe = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    extra = json.dumps({"oscar": {"rotations": path}})
    return [exe, "serve", model, "--attention-backend", "OSCAR", "--additional-config", extra, *engine_args]


def serve(model: str, rotations: str, engine_args: list[str]) -> int:
    """The launcher the ``vllm`` :class:`~oscar_math.hookspecs.EngineSpec` names; vLLM's exit status."""
    cmd = build_command(model, rotations, engine_args)
    print(
        "oscar serve: " + " ".join(cmd[:5]) + f" --additional-config '{cmd[6]}' " + " ".join(cmd[7:]),
        flush=True,
    )
    return subprocess.call(cmd)
