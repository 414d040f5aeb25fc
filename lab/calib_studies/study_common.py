"""What every long-context study script starts with (issue 13's studies 3, 3b, 4 and 5).

:func:`start_study` makes the output folder and a scratch folder, picks the device, fixes the
BF16 windows (sink 64 + recent 256), unpacks the shipped text snapshots (the same bytes on
every machine: ``long_context_study3.BUILTIN_SNAPSHOT`` / ``OTHER_SNAPSHOT``) and starts the
JSON report with the run's provenance (argv, Python, torch, device, text hashes). Only the
standard library, torch and ``oscar_calib.simulate`` are needed, so the scripts stay runnable
from a bare ``PYTHONPATH`` on the GPU machine.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oscar_calib.simulate import Windows

HERE = Path(__file__).resolve().parent
BUILTIN_SNAPSHOT = HERE / "data" / "pydoc-topics-py311.txt.gz"
OTHER_SNAPSHOT = HERE / "data" / "stdlib-docstrings-py311.txt.gz"


def snapshot(path: Path, tmp: Path) -> tuple[str, Path, str]:
    """``(text, path of the unpacked .txt, sha256[:16])`` of a shipped gzip snapshot."""
    raw = gzip.decompress(path.read_bytes())
    out = tmp / path.name.removesuffix(".gz")
    out.write_bytes(raw)
    return raw.decode("utf-8"), out, hashlib.sha256(raw).hexdigest()[:16]


@dataclass
class Study:
    """One study run's common state (see :func:`start_study`)."""

    out: Path
    tmp: Path
    dev: str
    windows: Windows
    text: str
    text_path: Path
    other: str
    report: dict[str, Any] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)

    def dump(self, name: str) -> Path:
        """Write the report (with the times so far) to ``out/name``; safe to call often."""
        self.report["times"] = {k: round(v, 2) for k, v in self.times.items()}
        p = self.out / name
        p.write_text(json.dumps(self.report, indent=1))
        return p


def start_study(out: str | Path, prefix: str) -> Study:
    """Output folder, scratch folder, device, windows, both text snapshots and the report's
    provenance (``argv``, ``python``, ``torch``, ``device``, ``texts``)."""
    o = Path(out)
    o.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {"argv": sys.argv, "python": sys.version.split()[0], "torch": torch.__version__}
    report["device"] = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    text, text_path, sha = snapshot(BUILTIN_SNAPSHOT, tmp)
    other, _, other_sha = snapshot(OTHER_SNAPSHOT, tmp)
    report["texts"] = {
        "builtin_snapshot": {"chars": len(text), "sha256_16": sha},
        "other_snapshot": {"chars": len(other), "sha256_16": other_sha},
    }
    return Study(o, tmp, dev, Windows(64, 256), text, text_path, other, report)


def add_split_args(ap: argparse.ArgumentParser, allow_empty: bool = True) -> None:
    """The studies' shared split options: selection on the calibration split, held-out and
    other text, each a list of contexts with a sequence count per context
    (``allow_empty``: an empty list skips that split)."""
    n = "*" if allow_empty else "+"
    ap.add_argument("--select-contexts", type=int, nargs=n, default=[2048, 8192])
    ap.add_argument("--select-seqs", type=int, nargs=n, default=[4, 2])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[4, 4, 2])
    ap.add_argument("--other-contexts", type=int, nargs=n, default=[2048, 8192])
    ap.add_argument("--other-seqs", type=int, nargs=n, default=[4, 2])
