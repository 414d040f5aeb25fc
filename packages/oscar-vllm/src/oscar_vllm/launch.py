"""``oscar serve --engine vllm MODEL --rotations FILE [--oscar-exclude-layers 0,5,29] [vLLM args...]``.

Checks the artifact (and the excluded layers) against the model's ``config.json`` first
(one-line :class:`~oscar_math.errors.OscarError` on a mismatch), then runs ``vllm serve``
with the OSCAR backend selected and the options passed through ``--additional-config``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from oscar_math.errors import OscarError
from oscar_math.model_config import model_geometry

from .settings import load_checked, settings_from

__all__ = ["model_geometry", "build_command", "serve"]

#: oscar serve's own option (vLLM has no such flag): comma-separated decoder layers kept in BF16
EXCLUDE_FLAG = "--oscar-exclude-layers"


def _pop_exclude(engine_args: list[str]) -> tuple[list[int] | None, list[str]]:
    """``--oscar-exclude-layers 0,5,29`` (or ``=0,5,29``) taken out of the vLLM arguments."""
    for i, a in enumerate(engine_args):
        if a == EXCLUDE_FLAG and i + 1 < len(engine_args):
            value, rest = engine_args[i + 1], engine_args[:i] + engine_args[i + 2 :]
        elif a.startswith(EXCLUDE_FLAG + "="):
            value, rest = a.partition("=")[2], engine_args[:i] + engine_args[i + 1 :]
        elif a == EXCLUDE_FLAG:
            raise OscarError(f"{EXCLUDE_FLAG} needs comma-separated layer indices")
        else:
            continue
        try:
            return [int(x) for x in value.split(",")], rest
        except ValueError:
            raise OscarError(f"{EXCLUDE_FLAG} takes comma-separated layer indices, got {value!r}") from None
    return None, list(engine_args)


def build_command(model: str, rotations: str, engine_args: list[str]) -> list[str]:
    """The ``vllm serve`` command line (after checking the artifact against ``model``)."""
    for flag in ("--attention-backend", "--additional-config"):
        if any(a == flag or a.startswith(flag + "=") for a in engine_args):
            raise OscarError(f"oscar serve sets {flag} itself; remove it from the vLLM arguments")
    exclude, engine_args = _pop_exclude(engine_args)
    layers, kv, head_dim = model_geometry(model)
    path = str(Path(rotations).expanduser().resolve())
    section: dict = {"rotations": path} if exclude is None else {"rotations": path, "exclude_layers": exclude}
    settings = settings_from({"oscar": section})
    load_checked(settings, layers, kv, head_dim)  # what every worker checks again
    if exclude is not None:
        section["exclude_layers"] = list(settings.exclude_layers)  # sorted
    exe = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    extra = json.dumps({"oscar": section})
    return [exe, "serve", model, "--attention-backend", "OSCAR", "--additional-config", extra, *engine_args]


def serve(model: str, rotations: str, engine_args: list[str]) -> int:
    """The launcher the ``vllm`` :class:`~oscar_math.hookspecs.EngineSpec` names; vLLM's exit status."""
    cmd = build_command(model, rotations, engine_args)
    print(
        "oscar serve: " + " ".join(cmd[:5]) + f" --additional-config '{cmd[6]}' " + " ".join(cmd[7:]),
        flush=True,
    )
    return subprocess.call(cmd)
