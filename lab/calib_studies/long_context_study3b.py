"""Long-context study 3, second run: calibration chunk length × token count, and the pre-RoPE key
mean (emulation only), after ``long_context_study3.py`` found that long chunks help 8k and hurt 2k.

The post-RoPE key mean the artifact stores depends on the positions it was averaged over
(:mod:`oscar_calib.rope_mean`); this run separates that from the sampling noise of few long
chunks (16384 tokens = 2 chunks of 8192) by calibrating on 4× the tokens, and bounds what a
position-aware mean would give. Same shipped text snapshots, windows and sequences as
``long_context_study3.py``; every in-format variant is ``α ** 0.7`` keys, ``α ** 0.5`` values.

::

    python lab/calib_studies/long_context_study3b.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context_run import BASELINES, score, table  # noqa: E402
from long_context_study3 import ABLATIONS  # noqa: E402
from study_common import BUILTIN_SNAPSHOT, add_split_args, start_study  # noqa: E402

from oscar_calib.calibrate import CalibrationConfig, calibration_chunks, rotations_from_statistics  # noqa: E402
from oscar_calib.capture import collect_statistics  # noqa: E402
from oscar_calib.models import load_model, model_name, tiny_random_model  # noqa: E402
from oscar_calib.rope_mean import RopeMeanScheme, prerope_key_means, rope_inv_freq  # noqa: E402
from oscar_calib.schemes import SchemeContext, build_scheme  # noqa: E402
from oscar_calib.text import split_text, token_chunks  # noqa: E402
from oscar_math.artifact import save_rotations  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="study3b")
    # (chunk length, tokens) pairs: LEN:TOKENS
    ap.add_argument(
        "--calib", nargs="+", default=["1024:16384", "8192:16384", "1024:65536", "4096:65536", "8192:65536"]
    )
    ap.add_argument(
        "--ropemean", nargs="+", default=["1024:16384", "8192:16384"], help="calibrations to centre by RoPE"
    )
    add_split_args(ap, allow_empty=False)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    st = start_study(args.out, "study3b")
    out, dev, windows, report, times = st.out, st.dev, st.windows, st.report, st.times
    text, text_path, other = st.text, st.text_path, st.other

    t = time.perf_counter()
    if args.tiny:
        model32, tok = tiny_random_model("llama", num_hidden_layers=2)
        model16 = model32
    else:
        model32, tok = load_model("smollm2", dtype=torch.float32, device=dev)
        model16, _ = load_model("smollm2", dtype=torch.bfloat16, device=dev)
    times["load"] = time.perf_counter() - t
    name = model_name("smollm2")

    t = time.perf_counter()
    arts: dict[str, Any] = {}
    means: dict[str, list[torch.Tensor]] = {}
    for spec in dict.fromkeys(args.calib + args.ropemean):
        length, tokens = (int(x) for x in spec.split(":"))
        cfg = CalibrationConfig(tokens=tokens, seq_len=length, text=str(text_path))
        chunks, _ = calibration_chunks(tok, cfg)
        stats = collect_statistics(
            model32, chunks, sink=cfg.sink, max_samples=cfg.max_samples, progress=False
        )
        cal = {
            "tokens": stats.tokens,
            "chunks": len(chunks),
            "seq_len": length,
            "text": BUILTIN_SNAPSHOT.name,
        }
        arts[spec] = rotations_from_statistics(stats, cfg, model=name, calibration=cal)
        if spec in args.ropemean:
            means[spec] = prerope_key_means(model32, chunks, sink=cfg.sink, layers=arts[spec].num_layers)
        print(f"calibrated {spec}: {len(chunks)} chunks", flush=True)
    times["calibrate"] = time.perf_counter() - t
    inv_freq = rope_inv_freq(model32)
    hd = next(iter(arts.values())).head_dim

    def ctx(r: Any) -> SchemeContext:
        return SchemeContext(hd, r.num_layers, r.num_kv_heads, r)

    def label(spec: str) -> str:
        length, tokens = spec.split(":")
        return f"L{length} x {int(tokens) // 1024}k tok"

    def oscar_schemes() -> dict[str, Any]:
        s = {
            f"oscar2 [{label(k)}]": build_scheme("oscar2", ctx(r)) for k, r in arts.items() if k in args.calib
        }
        for k in args.ropemean:
            s[f"ropemean [{label(k)}] (emulation)"] = RopeMeanScheme(
                build_scheme("oscar2", ctx(arts[k])), means[k], inv_freq
            )
        return s

    cal_text, held_text = split_text(text)
    t = time.perf_counter()
    report["selection"] = {}
    for c, n in zip(args.select_contexts, args.select_seqs, strict=True):
        res = score(model16, oscar_schemes(), token_chunks(tok, cal_text, c, c * n, 1234), windows)
        report["selection"][str(c)] = res
        print(table(f"SELECTION (calibration split) context {c}", res), flush=True)
    times["select"] = time.perf_counter() - t

    def sel(v: str) -> float:
        return statistics.fmean(
            statistics.fmean(report["selection"][str(c)]["schemes"][v]["kl"]) for c in args.select_contexts
        )

    in_format = [
        v for v in report["selection"][str(args.select_contexts[0])]["schemes"] if v.startswith("oscar2")
    ]
    chosen = min(in_format, key=sel)
    report["chosen_in_format"] = chosen
    print(f"chosen (in format) on the calibration split: {chosen!r} {sel(chosen):.4f}", flush=True)
    spec_of = {f"oscar2 [{label(k)}]": k for k in args.calib}
    chosen_rot = arts[spec_of[chosen]]
    save_rotations(out / "smollm2-chosen.safetensors", chosen_rot)

    for part, body, cs, ns, full in (
        ("heldout", held_text, args.contexts, args.num_seqs, True),
        ("other", other, args.other_contexts, args.other_seqs, False),
    ):
        t = time.perf_counter()
        report[part] = {}
        for c, n in zip(cs, ns, strict=True):
            schemes = {b: build_scheme(b, ctx(chosen_rot)) for b in BASELINES}
            schemes.update(oscar_schemes())
            if full:
                schemes.update(
                    {f"{a} [{label(spec_of[chosen])}]": build_scheme(a, ctx(chosen_rot)) for a in ABLATIONS}
                )
            bits = {k: s.bits_per_element(c, hd, 64, 256) for k, s in schemes.items()}
            res = score(model16, schemes, token_chunks(tok, body, c, c * n, 0), windows)
            res["bits"] = bits
            report[part][str(c)] = res
            print(table(f"{part.upper()} context {c}", res, bits), flush=True)
            (out / "study3b.json").write_text(json.dumps(report, indent=1))
        times[part] = time.perf_counter() - t
    report["times"] = times
    (out / "study3b.json").write_text(json.dumps(report, indent=1))
    print("times", {k: round(v, 1) for k, v in times.items()}, "total", round(time.perf_counter() - t0, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
