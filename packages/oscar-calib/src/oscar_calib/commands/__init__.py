"""Subcommands of the ``oscar`` CLI: one module each, exposing ``register(subparsers)`` and ``run(args)``.

``register`` adds the sub-parser; ``run`` receives the parsed ``argparse.Namespace`` and
returns the exit status. Plugins add commands through the ``oscar_cli_commands`` hook.
"""

from __future__ import annotations

from collections.abc import Sequence

BUILTIN_COMMANDS = ("calibrate", "eval", "demo", "inspect", "engines", "serve", "generate")

__all__ = ["BUILTIN_COMMANDS", "format_table"]


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, align: str = "") -> str:
    """A plain-text table: a header, a rule, rows; columns padded to their widest cell.

    ``align`` holds one character per column, ``l`` or ``r`` (default: numbers right,
    text left, judged from the first row).
    """
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    if not align:

        def _numeric(value: object) -> bool:
            return isinstance(value, (int, float)) or str(value).replace(".", "", 1).lstrip("-").isdigit()

        align = "".join("r" if rows and _numeric(rows[0][i]) else "l" for i in range(len(header)))

    def _line(row: list[str]) -> str:
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(row, widths, align, strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([_line(cells[0]), rule, *(_line(r) for r in cells[1:])])
