"""Subcommands of the ``oscar`` CLI: one module each, exposing ``register(subparsers)`` and ``run(args)``.

``register`` adds the sub-parser; ``run`` receives the parsed ``argparse.Namespace`` and
returns the exit status. Plugins add commands through the ``oscar_cli_commands`` hook.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from oscar_math.artifact import DEFAULT_RECENT, DEFAULT_SINK
from oscar_math.errors import OscarError

BUILTIN_COMMANDS = ("calibrate", "eval", "demo", "inspect", "engines", "serve", "generate")

__all__ = ["BUILTIN_COMMANDS", "check_context", "check_output_dir", "check_output_file", "format_table"]


def _blocking_file(path: Path) -> Path | None:
    """The first existing non-folder among ``path``'s parents (it blocks creating ``path``)."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def check_output_file(option: str, value: str, *, suffixes: Sequence[str] = ()) -> Path:
    """Check an output-file argument before any work is done; errors name ``option`` and ``value``.

    The file may exist (it is replaced); it must not be a folder, and no existing file may
    stand where one of its parent folders has to be created. ``suffixes`` (e.g.
    ``(".png",)``): the name must end in one of them.
    """
    path = Path(value).expanduser()
    if path.is_dir():
        example = path / f"name{suffixes[0] if suffixes else ''}"
        raise OscarError(f"{option} {value}: is a folder; give a file name, e.g. {example}")
    blocker = _blocking_file(path)
    if blocker is not None:
        raise OscarError(f"{option} {value}: cannot create a folder at {blocker}, a file is there")
    if suffixes and path.suffix.lower() not in suffixes:
        raise OscarError(f"{option} {value}: expected a file name ending in {' or '.join(suffixes)}")
    return path


def check_output_dir(option: str, value: str) -> Path:
    """Check an output-folder argument (created if missing); errors name ``option`` and ``value``."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise OscarError(f"{option} {value}: is a file, expected a folder (it is created if missing)")
    blocker = _blocking_file(path)
    if blocker is not None:
        raise OscarError(f"{option} {value}: cannot create a folder at {blocker}, a file is there")
    return path


def check_context(option: str, lengths: Sequence[int], max_positions: int) -> None:
    """Refuse token lengths past the model's ``max_position_embeddings`` (0: unknown, no limit).

    Past that length RoPE positions were never trained: perplexity and the KV statistics
    there measure a broken model, not the quantisation.
    """
    too_long = [n for n in lengths if max_positions and n > max_positions]
    if too_long:
        raise OscarError(
            f"{option} {' '.join(map(str, too_long))}: longer than the model's context limit "
            f"(max_position_embeddings {max_positions})"
        )


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


def serving_windows(sink: int | None, recent: int | None, rotations: object | None) -> tuple[int, int]:
    """The BF16 windows to evaluate: the artifact's (what every engine serves) unless ``--sink`` /
    ``--recent`` override them, which is said on stderr; 64 / 256 without an artifact."""
    import sys

    if rotations is None:
        return (DEFAULT_SINK if sink is None else sink), (DEFAULT_RECENT if recent is None else recent)
    a_sink, a_recent = int(rotations.sink_tokens), int(rotations.recent_tokens)  # type: ignore[attr-defined]
    got = (a_sink if sink is None else sink), (a_recent if recent is None else recent)
    if got != (a_sink, a_recent):
        print(
            f"oscar: note: evaluating windows of {got[0]} sink + {got[1]} recent tokens; the artifact's "
            f"(what the engines serve) are {a_sink} + {a_recent}",
            file=sys.stderr,
        )
    return got
