"""``oscar engines``: installed engine integrations and whether their engine imports."""

from __future__ import annotations

import argparse

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser(
        "engines",
        help="list installed serving-engine plugins and whether their engine imports",
        description="List the serving-engine integrations registered through the 'oscar' plugin hooks.",
    )


def run(args: argparse.Namespace) -> int:
    from oscar_math.plugins import available_engines, plugin_load_errors

    from . import format_table

    engines = available_engines()
    errors = plugin_load_errors()
    if not engines:
        print("no engine plugins installed (pip install oscar-vllm or oscar-sglang)")
    else:
        rows = [
            [
                spec.name,
                spec.package,
                spec.module,
                "yes" if ok else "no",
                "" if ok else (error or ""),
            ]
            for spec, ok, error in engines
        ]
        print(format_table(["engine", "plugin package", "module", "imports", "error"], rows))
    for name, error in sorted(errors.items()):
        print(f"plugin {name!r} failed to load: {error}")
    return 0
