"""Make the issue-13 artifacts on CPU from ONE calibration pass: the row-search artifacts
(previous default and power variants) and the output-search ones (new default and its
ablations), plus the output objective of each on the search sequences.

The output search (:mod:`oscar_calib.output_clip`) refines per-KV-head clip ratios by the
attention-output error under serving windows on calibration-split sequences; before trusting
it, its objective is checked against the end-to-end ranking the H200 study measured for the
global key powers (pK.5 / pK.7 / pK1: 8k KL 0.071 / 0.053 / 0.073 on the calibration split).
Artifacts and ``output_clip_study.json`` go to ``--out``; ``long_context_eval.py`` evaluates them::

    OMP_NUM_THREADS=2 python lab/calib_studies/output_clip_study.py --out issue13-artifacts
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from oscar_calib.calibrate import (
    CalibrationConfig,
    _single_thread,
    calibration_chunks,
    rotations_from_statistics,
    search_chunks,
)
from oscar_calib.capture import collect_statistics
from oscar_calib.models import load_model, model_info
from oscar_calib.output_clip import capture_layers, output_metrics, search_output_clip
from oscar_math.artifact import Rotations, load_rotations, save_rotations


def with_clips(r: Rotations, k: list[torch.Tensor], v: list[torch.Tensor], **meta: object) -> Rotations:
    cal = {**r.calibration, **meta}
    for key in ("clip_power", "value_clip_power"):
        cal.pop(key, None)
    return dataclasses.replace(r, k_clip=tuple(k), v_clip=tuple(v), calibration=cal)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="issue13-artifacts")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--search-context", type=int, default=8192)
    ap.add_argument("--search-seqs", type=int, default=2)
    ap.add_argument(
        "--gradients",
        action="store_true",
        help="score by the empirical Fisher Σ (gᵀ(ô − o))² (g: the loss gradient w.r.t. the attention "
        "output) instead of the o_proj metric; needs a backward pass per search sequence",
    )
    ap.add_argument(
        "--row",
        default=None,
        help="reuse this row-search pK.7 pV.5 artifact (pK.5 / pK1 are derived from its ratios: "
        "searched = stored ** (1 / 0.7)) instead of a new calibration pass",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.tiny:
        from oscar_calib.models import tiny_random_model

        model, tok = tiny_random_model("llama")
        base = CalibrationConfig(tokens=2048, seq_len=1024, search_context=2048, search_seqs=1)
    else:
        model, tok = load_model("smollm2")
        base = CalibrationConfig(  # chunks of 1024: the CLI's default when this study ran
            tokens=args.tokens, seq_len=1024, search_context=args.search_context, search_seqs=args.search_seqs
        )
    info = model_info(model)
    row = {}
    if args.row:
        r7 = load_rotations(args.row)
        for pk in (0.5, 0.7, 1.0):
            k = tuple(c ** (pk / 0.7) for c in r7.k_clip)
            row[pk] = dataclasses.replace(r7, k_clip=k, calibration={**r7.calibration, "clip_power": pk})
    else:
        chunks, source = calibration_chunks(tok, base)
        stats = collect_statistics(
            model, chunks, sink=base.sink, max_samples=base.max_samples, seed=base.seed
        )
        print(f"statistics {time.perf_counter() - t0:.0f} s", flush=True)
        cal = {"tokens": stats.tokens, "text": source, "seq_len": base.seq_len}
        with _single_thread():
            for pk in (0.5, 0.7, 1.0):
                cfg = dataclasses.replace(base, clip_search="row", clip_power=pk, value_clip_power=0.5)
                row[pk] = rotations_from_statistics(stats, cfg, model="smollm2", calibration=dict(cal))
        save_rotations(out / "row-pK.7.safetensors", row[0.7])  # the previous default
    search = search_chunks(tok, base, info.max_positions)
    caps = capture_layers(
        model,
        search,
        first_row=base.sink + base.recent,
        row_stride=base.search_row_stride,
        gradients=args.gradients,
    )
    metrics = output_metrics(model, info.num_q_heads, info.head_dim)
    print(f"captured {len(search)} x {search[0].numel()} tokens {time.perf_counter() - t0:.0f} s", flush=True)
    report: dict[str, object] = {
        "search_tokens": [len(search), int(search[0].numel())],
        "objective": {},
        "weighting": "empirical Fisher (loss gradient)" if args.gradients else "o_proj metric",
    }
    kw = {"sink": base.sink, "recent": base.recent}

    def objective(name: str, res) -> None:  # type: ignore[no-untyped-def]
        report["objective"][name] = {  # type: ignore[index]
            "start": sum(res.error_start),
            "chosen": sum(res.error_chosen),
            "unclipped": sum(res.error_unclipped),
            "per_layer_chosen_over_start": [
                round(c / s, 4) for c, s in zip(res.error_chosen, res.error_start, strict=True)
            ],
        }
        print(
            name, {k: v for k, v in report["objective"][name].items() if k != "per_layer_chosen_over_start"}
        )  # type: ignore[index]
        (out / "output_clip_study.json").write_text(json.dumps(report, indent=1))

    with _single_thread():
        for pk in (0.5, 0.7, 1.0):
            t = time.perf_counter()
            res = search_output_clip(caps, metrics, row[pk], search_keys=False, search_values=False, **kw)
            objective(f"row pK{pk} pV.5 (no search)", res)
            print(f"  {time.perf_counter() - t:.0f} s", flush=True)
        t = time.perf_counter()
        full = search_output_clip(caps, metrics, row[0.7], **kw)
        objective("output search K then V (start: row pK.7 pV.5) = new default", full)
        print(f"  {time.perf_counter() - t:.0f} s", flush=True)
        new = with_clips(row[0.7], full.k_clip, full.v_clip, clip_search={"keys": True, "values": True})
        save_rotations(out / "output-KV.safetensors", new)
        k_only = with_clips(row[0.7], full.k_clip, list(row[0.7].v_clip), clip_search={"keys": True})
        save_rotations(out / "output-K.safetensors", k_only)
        vres = search_output_clip(caps, metrics, row[0.7], search_keys=False, **kw)
        objective("output search V only (K at row pK.7)", vres)
        save_rotations(
            out / "output-V.safetensors",
            with_clips(row[0.7], list(row[0.7].k_clip), vres.v_clip, clip_search={"values": True}),
        )
    report["k_clip_mean"] = {
        "row pK.7": float(torch.stack(row[0.7].k_clip).mean()),
        "output": float(torch.stack(full.k_clip).mean()),
    }
    report["v_clip_mean"] = {
        "row pV.5": float(torch.stack(row[0.7].v_clip).mean()),
        "output": float(torch.stack(full.v_clip).mean()),
    }
    report["k_clip"] = [c.tolist() for c in full.k_clip]
    report["v_clip"] = [c.tolist() for c in full.v_clip]
    report["seconds"] = time.perf_counter() - t0
    (out / "output_clip_study.json").write_text(json.dumps(report, indent=1))
    print({k: report[k] for k in ("k_clip_mean", "v_clip_mean", "seconds")})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
