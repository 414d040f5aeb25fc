"""Write held-out text of another kind than the built-in one: Python standard-library docstrings.

The built-in calibration text is ``pydoc_data.topics`` (the language reference's help
topics). This script collects the docstrings of a fixed list of standard-library modules
and their public classes and functions (API documentation, a different document set),
in a fixed order, so a long-context claim can be checked on text calibration never saw::

    python lab/calib_studies/other_text.py --out stdlib-docstrings.txt
"""

from __future__ import annotations

import argparse
import importlib
import inspect
from pathlib import Path

MODULES = (
    "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "concurrent.futures",
    "configparser", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "gzip", "hashlib", "heapq", "http.client", "imaplib",
    "inspect", "ipaddress", "itertools", "json", "logging", "mailbox", "multiprocessing", "numbers",
    "operator", "optparse", "os", "pathlib", "pickle", "platform", "queue", "random", "re",
    "sched", "secrets", "shlex", "shutil", "smtplib", "socket", "sqlite3", "ssl", "statistics",
    "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "turtle", "typing", "unittest", "urllib.parse", "urllib.request",
    "uuid", "warnings", "weakref", "xml.etree.ElementTree", "zipfile", "zoneinfo",
)  # fmt: skip


def stdlib_docstrings() -> str:
    """Docstrings of :data:`MODULES` and their public members, paragraphs separated by blank lines."""
    parts: list[str] = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # a module missing on this Python build
            continue
        doc = inspect.getdoc(mod)
        if doc:
            parts.append(f"{name}\n\n{doc}")
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if (
                not (inspect.isclass(obj) or inspect.isfunction(obj))
                or getattr(obj, "__module__", "") != name
            ):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 200:
                parts.append(f"{name}.{attr}\n\n{doc}")
    return "\n\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="stdlib-docstrings.txt")
    args = ap.parse_args()
    text = stdlib_docstrings()
    Path(args.out).write_text(text)
    print(f"wrote {args.out}: {len(text)} characters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
