"""``oscar serve --engine NAME MODEL --rotations FILE [engine args...]``: start a serving engine with OSCAR.

The command only dispatches: each engine plugin names its launcher in its
:class:`~oscar_math.hookspecs.EngineSpec` (``launcher="module:function"``), which checks
the artifact against the model first and then starts the engine with the remaining
arguments passed through unchanged. A built-in model name (``smollm2``) is resolved here to
its converted folder, as ``oscar calibrate smollm2`` resolves it (the engine plugins do not
depend on oscar-calib), and served under that name (``--served-model-name smollm2``, a flag
vLLM and SGLang both take) unless the arguments name one.
"""

from __future__ import annotations

import argparse
import importlib

from oscar_math.errors import OscarError

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="start a serving engine (vllm, sglang) with the OSCAR INT2 KV cache",
        description=(
            "Check a rotations artifact against MODEL, then start the engine's server with "
            "the OSCAR backend selected. Arguments after MODEL that oscar does not know are "
            "passed to the engine unchanged (e.g. --port 8000 --max-model-len 8192)."
        ),
    )
    parser.add_argument("--engine", required=True, help="engine plugin to use (see 'oscar engines')")
    parser.add_argument(
        "model", help="model folder, 'smollm2' (the built-in model, fetched once), or a name the engine takes"
    )
    parser.add_argument("--rotations", required=True, help="artifact written by 'oscar calibrate'")


def _launcher(engine: str):  # noqa: ANN202 - returns the plugin's function
    from oscar_math.plugins import available_engines

    engines = {spec.name: (spec, ok, error) for spec, ok, error in available_engines()}
    if engine not in engines:
        known = ", ".join(sorted(engines)) or "none installed"
        raise OscarError(f"--engine {engine!r}: no such engine plugin (installed: {known})")
    spec, ok, error = engines[engine]
    if not ok:
        raise OscarError(f"--engine {engine!r}: the engine module '{spec.module}' does not import ({error})")
    if not spec.launcher:
        raise OscarError(f"--engine {engine!r}: plugin {spec.package} cannot be launched by 'oscar serve'")
    module_name, func_name = spec.launcher.split(":")
    return getattr(importlib.import_module(module_name), func_name)


#: the engines' flag for the model name clients send (vLLM and SGLang alike)
SERVED_NAME = "--served-model-name"


def resolve(model: str, engine_args: list[str]) -> tuple[str, list[str]]:
    """``(model folder, engine args)``: a built-in name becomes its cached folder, served under that name."""
    from ..models import BUILTIN_MODELS, resolve_model

    if model not in BUILTIN_MODELS:
        return model, engine_args
    folder = str(resolve_model(model))
    if any(a == SERVED_NAME or a.startswith(SERVED_NAME + "=") for a in engine_args):
        return folder, engine_args
    return folder, [*engine_args, SERVED_NAME, model]


def run(args: argparse.Namespace) -> int:
    launch = _launcher(args.engine)
    model, engine_args = resolve(args.model, list(getattr(args, "engine_args", [])))
    return int(launch(model, args.rotations, engine_args) or 0)
