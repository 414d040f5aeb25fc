"""The ``oscar`` command: parse arguments, dispatch to a subcommand, map user errors to exit 2.

The CLI stays thin: each built-in subcommand lives in ``oscar_calib.commands.<name>``
with ``register(subparsers)`` and ``run(args) -> int``. Plugins add subcommands through
the ``oscar_cli_commands`` hook (:mod:`oscar_math.hookspecs`): they add a sub-parser and
set ``func`` as its default, which is called with the parsed arguments. Known user
mistakes (bad arguments, missing files, malformed artifacts) print one line on stderr
and exit 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

from .commands import BUILTIN_COMMANDS

__all__ = ["EXIT_USAGE", "build_parser", "main"]

#: exit status for user errors (argparse uses the same).
EXIT_USAGE = 2


def _builtin_modules() -> list[Any]:
    modules = []
    for name in BUILTIN_COMMANDS:
        qualified = f"{__package__}.commands.{name}"
        # A command module that does not exist (yet) is skipped; one that exists but
        # fails to import is a bug and must fail loudly.
        if importlib.util.find_spec(qualified) is None:
            continue
        modules.append(importlib.import_module(qualified))
    return modules


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """The argument parser and a map from built-in subcommand name to its module."""
    parser = argparse.ArgumentParser(
        prog="oscar",
        description="OSCAR: 2-bit KV-cache quantisation with attention-aware rotations.",
    )
    from .calibrate import tool_version

    parser.add_argument("--version", action="version", version=f"oscar {tool_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    handlers: dict[str, Any] = {}
    for module in _builtin_modules():
        before = set(subparsers.choices)
        module.register(subparsers)
        for name in set(subparsers.choices) - before:
            handlers[name] = module
    from oscar_math.plugins import add_plugin_commands

    add_plugin_commands(subparsers)
    return parser, handlers


def _known_errors() -> tuple[type[BaseException], ...]:
    from oscar_math.errors import OscarError

    return (OscarError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.strerror}: {exc.filename}"
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``oscar`` command; returns the exit status."""
    parser, handlers = build_parser()
    try:
        # Only `oscar serve` takes arguments it does not know: they go to the engine.
        args, extra = parser.parse_known_args(argv)
        if extra and args.command != "serve":
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.engine_args = extra
    except SystemExit as exc:  # argparse already printed usage and a one-line error (or help)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    try:
        if args.command in handlers:
            return int(handlers[args.command].run(args) or 0)
        func = getattr(args, "func", None)
        if func is None:
            print(f"oscar {args.command}: error: the plugin command sets no func", file=sys.stderr)
            return EXIT_USAGE
        return int(func(args) or 0)
    except _known_errors() as exc:
        print(f"oscar {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"oscar {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
