"""The plugin manager: built-ins, then the ``oscar`` entry point group.

``OSCAR_PLUGINS`` limits which entry points load: unset loads all, a comma list
loads only those entry-point names, an empty string loads none (built-ins always
load). A plugin that fails to import does not break the registry: its error is
kept (:func:`plugin_load_errors`) and shown by ``oscar engines``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
from importlib.metadata import entry_points

import pluggy

from . import hookspecs
from .errors import OscarError
from .hookspecs import PROJECT, EngineSpec, SchemeSpec, hookimpl

__all__ = [
    "DEFAULT_PLUGINS",
    "ENV_VAR",
    "hookimpl",
    "get_plugin_manager",
    "plugin_load_errors",
    "available_schemes",
    "available_engines",
    "add_plugin_commands",
]

#: modules registered before any entry point (built-ins use the same hooks as plugins).
DEFAULT_PLUGINS: tuple[str, ...] = ()
#: environment variable limiting which entry points load.
ENV_VAR = "OSCAR_PLUGINS"

_load_errors: dict[str, str] = {}


def _first_line(e: BaseException) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@functools.cache
def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide :class:`pluggy.PluginManager` (built once; ``.cache_clear()`` rebuilds)."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    _load_errors.clear()
    wanted = os.environ.get(ENV_VAR)
    allow = None if wanted is None else {n.strip() for n in wanted.split(",") if n.strip()}
    # pluggy's load_setuptools_entrypoints stops at the first broken plugin; we keep going
    for ep in entry_points(group=PROJECT):
        if (allow is not None and ep.name not in allow) or pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
        except Exception as e:  # a broken plugin must not take the CLI down with it
            _load_errors[ep.name] = f"{ep.value}: {_first_line(e)}"
            continue
        pm.register(plugin, name=ep.name)
    return pm


def plugin_load_errors() -> dict[str, str]:
    """Entry points that failed to load: ``{entry point name: "module: Error: message"}``."""
    get_plugin_manager()
    return dict(_load_errors)


def _collect(hook_name: str, kind: type, pm: pluggy.PluginManager | None) -> list[tuple[str, object]]:
    pm = pm or get_plugin_manager()
    out = []
    for impl in getattr(pm.hook, hook_name).get_hookimpls():
        items = impl.function() or []
        for item in items:
            if not isinstance(item, kind):
                raise OscarError(
                    f"Invalid {hook_name} result from plugin {impl.plugin_name!r}: "
                    f"expected {kind.__name__}, got {type(item).__name__}"
                )
            out.append((impl.plugin_name, item))
    return out


def _by_name(pairs: list[tuple[str, object]], what: str) -> dict[str, object]:
    seen: dict[str, tuple[str, object]] = {}
    for plugin, spec in pairs:
        name = spec.name  # type: ignore[attr-defined]
        if name in seen:
            raise OscarError(
                f"Duplicate {what} name {name!r}: registered by plugins {seen[name][0]!r} and {plugin!r}"
            )
        seen[name] = (plugin, spec)
    return {n: s for n, (_, s) in seen.items()}


def available_schemes(pm: pluggy.PluginManager | None = None) -> dict[str, SchemeSpec]:
    """All registered schemes by name (``oscar_schemes`` hook); duplicate names raise :class:`OscarError`."""
    return _by_name(_collect("oscar_schemes", SchemeSpec, pm), "scheme")  # type: ignore[return-value]


def available_engines(
    pm: pluggy.PluginManager | None = None,
) -> list[tuple[EngineSpec, bool, str | None]]:
    """All registered engines with whether their module imports: ``[(spec, importable, error)]``.

    Imports each engine's module now (only here), so listing plugins stays cheap.
    """
    specs = _by_name(_collect("oscar_engines", EngineSpec, pm), "engine")
    out: list[tuple[EngineSpec, bool, str | None]] = []
    for spec in specs.values():
        try:
            importlib.import_module(spec.module)  # type: ignore[attr-defined]
        except Exception as e:  # ImportError, or an engine that fails while importing
            out.append((spec, False, _first_line(e)))  # type: ignore[arg-type]
        else:
            out.append((spec, True, None))  # type: ignore[arg-type]
    return out


def add_plugin_commands(
    subparsers: argparse._SubParsersAction, pm: pluggy.PluginManager | None = None
) -> None:
    """Let every plugin add its subcommands (``oscar_cli_commands`` hook)."""
    (pm or get_plugin_manager()).hook.oscar_cli_commands(subparsers=subparsers)
