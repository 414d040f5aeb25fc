"""Long-context study 3 (issue 13): calibration chunk length and per-block clip powers chosen by KL.

Everything on text shipped with the repository (``data/pydoc-topics-py311.txt.gz``: the
built-in corpus as Python 3.11 builds it; ``data/stdlib-docstrings-py311.txt.gz``: the
other text), so the numbers do not depend on the Python version of the machine
(``pydoc_data.topics`` differs between 3.11 and 3.12: the "same" held-out sequences gave
bf16 perplexity 10.9 on one machine and 8.0 on the other).

1. Calibrate SmolLM2 (float32 model, as ``oscar calibrate`` loads it) on ``--tokens`` of the
   calibration part, in chunks of every ``--chunks`` length, plus one bf16-model control at
   1024; derive uniform-power variants ``α ** pK`` (values ``α ** 0.5``).
2. **Selection** on the calibration split (4 × 2k, 2 × 8k, seed 1234): lowest mean KL over
   the two contexts picks the chunk length and key power.
3. **KL power search** (``calibrate(clip_search="kl")``'s own code path): per-block key/value
   powers from the chosen variant, on the search sequences (2 × 8k of the calibration part,
   seed 1), then scored on the selection sequences like every other variant.
4. **Confirmation** on the held-out part (4 × 2k, 4 × 4k, 2 × 8k) with every baseline and the
   ablations, and on the other text (4 × 2k, 2 × 8k). Bits/element include the windows.

Writes ``study3.json`` (per-sequence values) and the compared artifacts under ``--out``::

    python lab/calib_studies/long_context_study3.py --out $OUT
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context_run import BASELINES, score, table  # noqa: E402
from study_common import BUILTIN_SNAPSHOT, OTHER_SNAPSHOT, add_split_args, snapshot, start_study  # noqa: E402,F401

from oscar_calib.calibrate import (  # noqa: E402
    CalibrationConfig,
    calibration_chunks,
    refine_clip_powers_by_kl,
    rotations_from_statistics,
    search_chunks,
)
from oscar_calib.capture import collect_statistics  # noqa: E402
from oscar_calib.models import load_model, model_name, tiny_random_model  # noqa: E402
from oscar_calib.power_search import apply_clip_powers  # noqa: E402
from oscar_calib.schemes import SchemeContext, build_scheme  # noqa: E402
from oscar_calib.text import builtin_text, split_text, token_chunks  # noqa: E402
from oscar_math.artifact import save_rotations  # noqa: E402

ABLATIONS = ("oscar2-noclip", "oscar2-nocenter", "oscar2-norot", "oscar2-calclip")


def mean_kl_of(res: dict[str, Any], name: str) -> float:
    return statistics.fmean(res["schemes"][name]["kl"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="study3")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--powers", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--search-context", type=int, default=8192)
    add_split_args(ap, allow_empty=False)
    ap.add_argument("--budget-s", type=float, default=400.0, help="wall budget; the KL search is cut to fit")
    ap.add_argument("--tiny", action="store_true", help="smoke test: a tiny random llama on CPU")
    args = ap.parse_args()
    t_start = time.perf_counter()
    st = start_study(args.out, "study3")
    out, dev, windows, report, times = st.out, st.dev, st.windows, st.report, st.times
    text, text_path, other = st.text, st.text_path, st.other
    here_text = builtin_text()
    report["texts"]["this_python_pydoc_topics"] = {
        "chars": len(here_text),
        "sha256_16": hashlib.sha256(here_text.encode()).hexdigest()[:16],
        "equals_snapshot": here_text == text,
    }
    print("texts", json.dumps(report["texts"]), flush=True)

    t = time.perf_counter()
    if args.tiny:
        model32, tok = tiny_random_model("llama", num_hidden_layers=2)
        model16 = model32
    else:
        model32, tok = load_model("smollm2", dtype=torch.float32, device=dev)
        model16, _ = load_model("smollm2", dtype=torch.bfloat16, device=dev)
    times["load"] = time.perf_counter() - t
    name = model_name("smollm2")
    print(f"device {report['device']}, load {times['load']:.1f} s", flush=True)

    # 1. calibration: one statistics pass per chunk length, searched ratios (powers 1)
    t = time.perf_counter()
    searched: dict[str, Any] = {}
    configs: dict[str, CalibrationConfig] = {}
    runs = [(f"L{c}", c, model32) for c in args.chunks] + [("L1024-bf16model", 1024, model16)]
    for tag, chunk, m in runs:
        cfg = CalibrationConfig(
            tokens=args.tokens,
            seq_len=min(chunk, args.tokens),
            text=str(text_path),
            clip_power=1.0,
            value_clip_power=1.0,
            search_context=args.search_context,
            power_blocks=args.blocks,
        )
        chunks, _ = calibration_chunks(tok, cfg)
        stats = collect_statistics(
            m, chunks, sink=cfg.sink, max_samples=cfg.max_samples, seed=cfg.seed, progress=False
        )
        cal = {
            "tokens": stats.tokens,
            "chunks": len(chunks),
            "seq_len": cfg.seq_len,
            "text": BUILTIN_SNAPSHOT.name,
        }
        cal["model_dtype"] = str(next(m.parameters()).dtype)
        searched[tag] = rotations_from_statistics(stats, cfg, model=name, calibration=cal)
        configs[tag] = cfg
        print(f"calibrated {tag}: {stats.tokens} tokens in {len(chunks)} chunks", flush=True)
    times["calibrate"] = time.perf_counter() - t

    def uniform(tag: str, pk: float, pv: float = 0.5) -> Any:
        n = searched[tag].num_layers
        return apply_clip_powers(searched[tag], [pk] * n, [pv] * n)

    variants: dict[str, Any] = {}
    for c in args.chunks:
        for p in args.powers:
            variants[f"L{c} pK{p:g} pV.5"] = uniform(f"L{c}", p)
    variants["L1024 bf16-model pK0.7 pV.5"] = uniform("L1024-bf16model", 0.7)
    # oscar calibrate's default before this study: float32 model, chunks of 1024 (the first --chunks)
    previous = f"L{args.chunks[0]} pK0.7 pV.5"
    if previous not in variants:
        variants[previous] = uniform(f"L{args.chunks[0]}", 0.7)
    hd = searched[f"L{args.chunks[0]}"].head_dim

    def ctx(rot: Any) -> SchemeContext:
        return SchemeContext(hd, rot.num_layers, rot.num_kv_heads, rot)

    cal_text, held_text = split_text(text)
    select_seqs = {
        c: token_chunks(tok, cal_text, c, c * n, 1234)
        for c, n in zip(args.select_contexts, args.select_seqs, strict=True)
    }

    # 2. selection on the calibration split
    t = time.perf_counter()
    report["selection"] = {}
    for c, seqs in select_seqs.items():
        res = score(model16, {v: build_scheme("oscar2", ctx(r)) for v, r in variants.items()}, seqs, windows)
        report["selection"][str(c)] = res
        print(table(f"SELECTION (calibration split) context {c}", res), flush=True)
    times["select"] = time.perf_counter() - t

    def sel_kl(v: str) -> float:
        return statistics.fmean(mean_kl_of(report["selection"][str(c)], v) for c in select_seqs)

    uniform_best = min(variants, key=sel_kl)
    report["uniform_best"] = uniform_best
    print(
        f"best uniform variant on the calibration split: {uniform_best!r} ({sel_kl(uniform_best):.4f}); "
        f"previous default {previous!r} {sel_kl(previous):.4f}",
        flush=True,
    )
    best_tag = uniform_best.split()[0] if "bf16" not in uniform_best else "L1024-bf16model"
    best_pk = float(uniform_best.split("pK")[1].split()[0])

    # 3. KL power search from the best uniform variant: calibrate(clip_search="kl")'s code path
    t = time.perf_counter()
    spent = time.perf_counter() - t_start
    per_select = times["select"] / max(len(variants), 1)
    # held-out + other text ≈ 12 + 8 schemes of ~1.7 / ~1 selection units each; keep 25 % margin
    eval_cost = per_select * (12 * 1.7 + 8 * 1.0) * 1.25
    search_deadline = max(args.budget_s - spent - eval_cost, 0.0)
    print(
        f"KL search deadline {search_deadline:.0f} s (spent {spent:.0f} s, evaluation est. {eval_cost:.0f} s)"
    )
    cfg = dataclasses.replace(configs[best_tag], clip_power=best_pk, value_clip_power=0.5)
    search_seqs = search_chunks(tok, cfg)
    overlap = sum(any(torch.equal(a, b) for b in select_seqs.get(a.numel(), [])) for a in search_seqs)
    import oscar_calib.power_search as ps

    original = ps.search_clip_powers

    def with_deadline(*a: Any, **k: Any) -> Any:
        result = original(*a, deadline_s=search_deadline, **k)
        report["kl_search_result"] = dataclasses.asdict(result)
        return result

    ps.search_clip_powers = with_deadline  # the deadline is the study's, not calibrate()'s
    try:
        # the float32 model, as `oscar calibrate` loads it: the artifact is what the CLI makes
        kl_rot = refine_clip_powers_by_kl(model32, tok, searched[best_tag], cfg, progress=True)
    finally:
        ps.search_clip_powers = original
    times["kl_search"] = time.perf_counter() - t
    report["kl_search"] = kl_rot.calibration["clip_search"]
    report["kl_search"]["search_seqs_also_in_selection"] = int(overlap)
    report["kl_powers"] = kl_rot.calibration["clip_power_per_layer"]
    print("KL search:", json.dumps(report["kl_search"]), json.dumps(report["kl_powers"]), flush=True)
    kl_name = f"{best_tag} KL-search {args.blocks} blocks"
    res_kl = {}
    for c, seqs in select_seqs.items():
        r = score(model16, {kl_name: build_scheme("oscar2", ctx(kl_rot))}, seqs, windows)
        res_kl[str(c)] = r
        report["selection"][str(c)]["schemes"][kl_name] = r["schemes"][kl_name]
    kl_sel = statistics.fmean(mean_kl_of(r, kl_name) for r in res_kl.values())
    chosen = kl_name if kl_sel < sel_kl(uniform_best) else uniform_best
    report["chosen"] = chosen
    print(
        f"KL search on the selection split: {kl_sel:.4f} vs best uniform "
        f"{sel_kl(uniform_best):.4f}: chosen {chosen!r}"
    )
    arts = {"previous": variants[previous], "uniform_best": variants[uniform_best], "kl_search": kl_rot}
    for k, r in arts.items():
        save_rotations(out / f"smollm2-{k}.safetensors", r)
    chosen_rot = kl_rot if chosen == kl_name else variants[uniform_best]

    # 4. confirmation: held-out and other text
    def schemes_for(full: bool) -> dict[str, Any]:
        s = {b: build_scheme(b, ctx(chosen_rot)) for b in BASELINES}
        s[f"oscar2 [{previous}] (previous default)"] = build_scheme("oscar2", ctx(variants[previous]))
        s[f"oscar2 [{uniform_best}]"] = build_scheme("oscar2", ctx(variants[uniform_best]))
        s[f"oscar2 [{kl_name}]"] = build_scheme("oscar2", ctx(kl_rot))
        if full:
            s.update({a: build_scheme(a, ctx(chosen_rot)) for a in ABLATIONS})
        return s

    for part, body, cs, ns, full in (
        ("heldout", held_text, args.contexts, args.num_seqs, True),
        ("other", other, args.other_contexts, args.other_seqs, False),
    ):
        t = time.perf_counter()
        report[part] = {}
        for c, n in zip(cs, ns, strict=True):
            seqs = token_chunks(tok, body, c, c * n, 0)
            schemes = schemes_for(full)
            bits = {k: s.bits_per_element(c, hd, 64, 256) for k, s in schemes.items()}
            res = score(model16, schemes, seqs, windows)
            res["bits"] = bits
            report[part][str(c)] = res
            print(table(f"{part.upper()} context {c}", res, bits), flush=True)
            (out / "study3.json").write_text(json.dumps(report, indent=1))
        times[part] = time.perf_counter() - t
    report["times"] = times
    (out / "study3.json").write_text(json.dumps(report, indent=1))
    print(
        "times", {k: round(v, 1) for k, v in times.items()}, "total", round(time.perf_counter() - t_start, 1)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
