"""Hook specifications of the OSCAR plugin registry (pluggy project ``oscar``).

A plugin is a module (or object) with functions decorated ``@hookimpl`` named
like the specs below, registered through the ``oscar`` entry point group::

    # pyproject.toml of a plugin package
    [project.entry-points.oscar]
    myplugin = "my_package.oscar_plugin"

Built-in functionality registers through the same hooks (``DEFAULT_PLUGINS`` in
:mod:`oscar_math.plugins`). Plugin modules must import cheaply: never import an
engine (vLLM, SGLang) or Triton at module level. Documented in docs/hooks.md.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from .errors import check

__all__ = ["PROJECT", "hookspec", "hookimpl", "SchemeSpec", "EngineSpec"]

#: pluggy project name and entry point group.
PROJECT = "oscar"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class SchemeSpec:
    """A KV-cache quantisation scheme the evaluation harness can run.

    Attributes:
        name: unique identifier used on the command line (e.g. ``oscar``, ``kivi``).
        description: one line for listings.
        factory: builds the scheme; its signature is the harness's contract
            (oscar-calib documents the arguments it passes).
    """

    name: str
    description: str
    factory: Callable[..., Any]

    def __post_init__(self) -> None:
        check(
            isinstance(self.name, str) and self.name.strip() != "",
            "SchemeSpec.name",
            "a non-empty string",
            self.name,
        )
        check(callable(self.factory), "SchemeSpec.factory", "a callable", type(self.factory).__name__)


@dataclass(frozen=True)
class EngineSpec:
    """A serving-engine integration.

    Attributes:
        name: engine name (``vllm``, ``sglang``).
        module: the engine's importable top-level module, imported only when asked
            whether the engine is available.
        package: distribution that provides the integration (e.g. ``oscar-vllm``).
        description: one line for listings.
        launcher: ``"module:function"`` that starts the engine with OSCAR for
            ``oscar serve``: ``function(model: str, rotations: str, engine_args: list[str]) -> int``
            (exit status). It checks the artifact against the model before starting the
            engine and raises :class:`~oscar_math.errors.OscarError` for bad input.
            Empty: the integration cannot be launched from ``oscar serve``.
    """

    name: str
    module: str
    package: str
    description: str
    launcher: str = ""

    def __post_init__(self) -> None:
        check(
            isinstance(self.name, str) and self.name.strip() != "",
            "EngineSpec.name",
            "a non-empty string",
            self.name,
        )
        check(
            isinstance(self.module, str) and self.module != "",
            "EngineSpec.module",
            "a module name",
            self.module,
        )
        check(
            self.launcher == "" or (self.launcher.count(":") == 1 and all(self.launcher.split(":"))),
            "EngineSpec.launcher",
            "'' or 'module:function'",
            self.launcher,
        )


@hookspec
def oscar_schemes() -> list[SchemeSpec]:
    """Return the KV quantisation schemes this plugin provides, as :class:`SchemeSpec` objects.

    Called by :func:`oscar_math.plugins.available_schemes`, which merges the lists of
    all plugins; two schemes with the same name are an error that names both plugins.
    The built-in schemes (BF16, naive INT2, KIVI, Hadamard-only, OSCAR) are registered
    by oscar-calib through this same hook. Return an empty list for none.
    """


@hookspec
def oscar_engines() -> list[EngineSpec]:
    """Return the serving-engine integrations this plugin provides, as :class:`EngineSpec` objects.

    Called by :func:`oscar_math.plugins.available_engines` (and ``oscar engines``), which
    imports each engine's ``module`` only then, to report whether the engine is installed.
    The implementation itself must not import the engine.
    """


@hookspec
def oscar_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the ``oscar`` command.

    ``subparsers`` is the ``argparse`` sub-parser collection of the ``oscar`` command:
    call ``subparsers.add_parser(name, help=...)`` and ``parser.set_defaults(func=...)``;
    the CLI calls ``func(args)`` and uses its return value as the exit status.
    Called once per CLI invocation, in plugin registration order.
    """
