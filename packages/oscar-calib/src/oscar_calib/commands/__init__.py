"""Subcommands of the ``oscar`` CLI: one module each, exposing ``register(subparsers)`` and ``run(args)``.

``register`` adds the subparser (and must set nothing else global); ``run`` receives the
parsed ``argparse.Namespace`` and returns the exit status. Plugins add commands through
the ``oscar_cli_commands`` hook with objects of the same shape.
"""

BUILTIN_COMMANDS = ("calibrate", "eval", "demo", "inspect", "engines")

__all__ = ["BUILTIN_COMMANDS"]
