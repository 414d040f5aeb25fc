"""The ``oscar`` command: parse arguments, dispatch to a subcommand module, map errors to exit 2.

The CLI stays thin: each subcommand lives in ``oscar_calib.commands.<name>`` with
``register(subparsers)`` and ``run(args) -> int``. Plugins add subcommands through the
``oscar_cli_commands`` hook (see ``oscar_math.hookspecs``). Known user mistakes
(bad arguments, missing files, malformed artifacts) print one line on stderr and exit
2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from typing import Any

from .commands import BUILTIN_COMMANDS

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("oscar-calib")
    except Exception:  # not installed as a distribution (running from a source tree)
        from . import __version__

        return __version__


def _builtin_modules() -> list[Any]:
    modules = []
    for name in BUILTIN_COMMANDS:
        qualified = f"{__package__}.commands.{name}"
        # A command module that does not exist yet is skipped; one that exists but
        # fails to import is a bug and must fail loudly.
        if importlib.util.find_spec(qualified) is None:
            continue
        modules.append(importlib.import_module(qualified))
    return modules


def _plugin_commands() -> list[Any]:
    try:
        from oscar_math.plugins import get_plugin_manager
    except ImportError:  # registry not available: built-in commands only
        return []
    manager = get_plugin_manager()
    hook = getattr(manager.hook, "oscar_cli_commands", None)
    if hook is None:
        return []
    commands: list[Any] = []
    for result in hook():
        if result is None:
            continue
        commands.extend(result if isinstance(result, (list, tuple)) else [result])
    return commands


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    """The argument parser and a map from subcommand name to its module/object."""
    parser = argparse.ArgumentParser(
        prog="oscar",
        description="OSCAR: 2-bit KV-cache quantisation with attention-aware rotations.",
    )
    parser.add_argument("--version", action="version", version=f"oscar {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    handlers: dict[str, Any] = {}
    for command in [*_builtin_modules(), *_plugin_commands()]:
        before = set(subparsers.choices)
        command.register(subparsers)
        for name in set(subparsers.choices) - before:
            handlers[name] = command
    return parser, handlers


def _known_errors() -> tuple[type[BaseException], ...]:
    from oscar_math.errors import OscarError

    return (OscarError, FileNotFoundError, IsADirectoryError, PermissionError, NotADirectoryError)


def _one_line(exc: BaseException) -> str:
    message = str(exc).strip()
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        message = f"{exc.strerror}: {exc.filename}"
    first = message.splitlines()[0] if message else type(exc).__name__
    return first


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``oscar`` command; returns the exit status."""
    parser, handlers = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its one-line usage error
        return int(exc.code or 0)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    known = _known_errors()
    try:
        return int(handlers[args.command].run(args) or 0)
    except known as exc:
        print(f"oscar {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"oscar {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
