"""Long-context evaluation of artifacts made beforehand (issue 13, second study).

Unlike ``long_context_run.py`` it calibrates nothing: the artifacts come from
``output_clip_study.py`` on CPU (one calibration pass), so what is measured here is
exactly what ``oscar calibrate`` stores. Same serving semantics as ``oscar eval``
(:mod:`oscar_calib.simulate`, windows sink 64 + recent 256), same sequences as
``long_context_run.py`` (calibration split: seed 1234; held-out and other text: seed 0).

1. **Check on the calibration split** (4 × 2k, 2 × 8k): ``oscar2`` with every artifact.
2. **Held-out built-in text** (4 × 2k, 4 × 4k, 2 × 8k): every baseline, every artifact,
   and the ablations (``oscar2-noclip``, ``-nocenter``, ``-norot``) of ``--ablate``.
3. **Other text** (``--other-text``, 4 × 2k, 2 × 8k): baselines, every artifact.

::

    python lab/calib_studies/long_context_eval.py --out $OUT \\
        --artifact "row pK.7 (previous default)=art/row-pK.7.safetensors" \\
        --artifact "output K+V (new default)=art/output-KV.safetensors" --ablate "output K+V (new default)" \\
        --other-text stdlib-docstrings.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context_run import BASELINES, load_smollm2, score, table  # noqa: E402

from oscar_calib.schemes import SchemeContext, build_scheme  # noqa: E402
from oscar_calib.simulate import Windows  # noqa: E402
from oscar_calib.text import builtin_text, load_text, split_text, token_chunks  # noqa: E402
from oscar_math.artifact import load_rotations  # noqa: E402

ABLATIONS = ("oscar2-noclip", "oscar2-nocenter", "oscar2-norot")


def read_text(path: str) -> str:
    """A text file: ``.gz`` (a shipped snapshot, UTF-8) unpacked in memory, else :func:`load_text`."""
    if path.endswith(".gz"):
        import gzip

        return gzip.decompress(Path(path).read_bytes()).decode("utf-8")
    return load_text(path)


def clips_json(rotations: Any, path: str | Path) -> None:
    """Write an artifact's clip ratios and metadata (float32 values round-trip exactly)."""
    data = {
        "k_clip": [c.tolist() for c in rotations.k_clip],
        "v_clip": [c.tolist() for c in rotations.v_clip],
        "calibration": rotations.calibration,
    }
    Path(path).write_text(json.dumps(data))


def from_clips_json(base: Any, path: str | Path) -> Any:
    """``base`` with the clip ratios and metadata of :func:`clips_json`'s file."""
    import dataclasses

    data = json.loads(Path(path).read_text())
    dt = base.k_clip[0].dtype
    return dataclasses.replace(
        base,
        k_clip=tuple(torch.tensor(c, dtype=dt) for c in data["k_clip"]),
        v_clip=tuple(torch.tensor(c, dtype=dt) for c in data["v_clip"]),
        calibration=data["calibration"],
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="long-context-eval")
    ap.add_argument("--artifact", action="append", required=True, help="NAME=PATH")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="NAME=CLIPS.json: the first --artifact with the clip ratios of CLIPS.json (written by "
        "clips_json() below from an artifact that differs from it only in its clip ratios; the "
        "device call carries at most 64 MiB, four full artifacts do not fit beside the model)",
    )
    ap.add_argument("--ablate", default=None, help="NAME of the artifact whose ablations are run")
    ap.add_argument("--select-contexts", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--select-seqs", type=int, nargs="*", default=[4, 2])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[4, 4, 2])
    ap.add_argument("--baselines", nargs="*", default=list(BASELINES), help="default: int2 kivi2 hadamard2")
    ap.add_argument(
        "--text",
        default=None,
        help="built-in text to split (.txt, or .gz such as data/pydoc-topics-py311.txt.gz; default: this "
        "Python's pydoc_data.topics, which differs between Python versions)",
    )
    ap.add_argument(
        "--other-text", default=None, help=".txt/.jsonl, or .gz (data/stdlib-docstrings-py311.txt.gz)"
    )
    ap.add_argument("--other-contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--other-seqs", type=int, nargs="+", default=[4, 2])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    model, tok, dev = load_smollm2(times)
    windows = Windows(64, 256)
    arts = {}
    for spec in args.artifact:
        name, path = spec.split("=", 1)
        arts[name] = load_rotations(path)
    first = next(iter(arts.values()))
    for spec in args.variant:
        name, path = spec.split("=", 1)
        arts[name] = from_clips_json(first, path)
    hd = first.head_dim
    ctx = {n: SchemeContext(hd, r.num_layers, r.num_kv_heads, r) for n, r in arts.items()}
    base_ctx = ctx[args.ablate] if args.ablate else next(iter(ctx.values()))
    cal_text, held_text = split_text(read_text(args.text) if args.text else builtin_text())
    report: dict[str, Any] = {
        "artifacts": {n: r.calibration for n, r in arts.items()},
        "args": vars(args),
        "selection": {},
        "heldout": {},
        "other": {},
        "times": times,
    }

    def run(title: str, key: str, text: str, c: int, n: int, seed: int, schemes: dict[str, Any]) -> None:
        seqs = token_chunks(tok, text, c, c * n, seed)
        bits = {k: s.bits_per_element(c, hd, 64, 256) for k, s in schemes.items()}
        res = score(model, schemes, seqs, windows)
        res["bits"] = bits
        report[key][str(c)] = res
        print(table(f"{title}, context {c}", res, bits), flush=True)
        (out / "long_context_eval.json").write_text(json.dumps(report, indent=1))

    t = time.perf_counter()
    for c, n in zip(args.select_contexts, args.select_seqs, strict=True):
        schemes = {f"oscar2 [{a}]": build_scheme("oscar2", ctx[a]) for a in arts}
        run("CALIBRATION SPLIT", "selection", cal_text, c, n, 1234, schemes)
    times["selection"] = time.perf_counter() - t

    def full(ablations: bool) -> dict[str, Any]:
        s = {b: build_scheme(b, base_ctx) for b in args.baselines}
        s.update({f"oscar2 [{a}]": build_scheme("oscar2", ctx[a]) for a in arts})
        if ablations and args.ablate:
            s.update({f"{a} [{args.ablate}]": build_scheme(a, base_ctx) for a in ABLATIONS})
        return s

    t = time.perf_counter()
    for c, n in zip(args.contexts, args.num_seqs, strict=True):
        run("HELD-OUT built-in text", "heldout", held_text, c, n, 0, full(True))
    times["heldout"] = time.perf_counter() - t
    if args.other_text:
        t = time.perf_counter()
        other = read_text(args.other_text)
        for c, n in zip(args.other_contexts, args.other_seqs, strict=True):
            run(f"OTHER TEXT ({Path(args.other_text).name})", "other", other, c, n, 0, full(False))
        times["other"] = time.perf_counter() - t
    (out / "long_context_eval.json").write_text(json.dumps(report, indent=1))
    print("times", {k: round(v, 1) for k, v in times.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
