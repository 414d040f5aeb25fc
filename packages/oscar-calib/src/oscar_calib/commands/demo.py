"""``oscar demo``: calibrate SmolLM2 on the built-in text, evaluate every scheme, write table/JSON/plot.

Sized to finish on 2 CPU cores in well under 10 minutes (see docs/results.md for
the numbers it prints and for a longer run). Stages and their wall time are printed.
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["register", "run", "DEMO_CALIBRATION", "DEMO_EVAL"]

#: calibration of the demo (tokens of the calibration part of the built-in text).
DEMO_CALIBRATION = {"tokens": 4096, "seq_len": 1024, "granularity": "kv_head"}
#: evaluation of the demo.
DEMO_EVAL = {
    "schemes": None,  # None: oscar_calib.schemes.DEFAULT_SCHEMES (every built-in scheme and ablation)
    "contexts": (2048,),
    "num_sequences": 2,
    # SmolLM2-135M itself finds the key in only about half of 512-token prompts and a third
    # of 1024-token ones (bf16, held-out filler): short prompts, needles inside the INT2 region
    "needle_contexts": (512,),
    "needle_depths": (0.1, 0.25, 0.4),
    "needle_trials": 1,
    "needle_schemes": ("bf16", "int2", "kivi2", "hadamard2", "oscar2"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="calibrate smollm2 and compare every scheme (CPU, a few minutes)",
        description=(
            "Calibrate SmolLM2-135M on the calibration part of the built-in text, evaluate "
            "every KV scheme on the held-out part, print the table and write the calibrated "
            "artifact rotations.safetensors, results.json and results.png into DIR."
        ),
    )
    p.add_argument(
        "--out",
        default="oscar-demo",
        metavar="DIR",
        help="output folder for rotations.safetensors, results.json, results.png (default ./oscar-demo)",
    )
    p.add_argument("--model", default="smollm2", help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _stage(name: str, start: float, times: dict[str, float]) -> float:
    now = time.perf_counter()
    times[name] = now - start
    print(f"[demo] {name}: {now - start:.1f} s", flush=True)
    return now


def run(args: argparse.Namespace) -> int:
    import torch

    from oscar_math.artifact import save_rotations

    from ..calibrate import CalibrationConfig, calibrate
    from ..evaluate import EvalConfig, format_table, run_eval
    from ..models import load_model, model_name
    from ..plot import plot_result
    from ..schemes import DEFAULT_SCHEMES
    from . import check_output_dir

    out = check_output_dir("--out", args.out)
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t_all = t = time.perf_counter()
    print(f"[demo] torch threads: {torch.get_num_threads()}; output folder {out}", flush=True)
    model, tokenizer = load_model(args.model, dtype=torch.bfloat16)
    t = _stage("load model", t, times)
    rotations = calibrate(
        model,
        tokenizer,
        CalibrationConfig(**DEMO_CALIBRATION),
        model_name=model_name(args.model),
        progress=not args.quiet,
    )
    save_rotations(out / "rotations.safetensors", rotations)
    t = _stage(f"calibrate ({DEMO_CALIBRATION['tokens']} tokens)", t, times)
    settings = dict(DEMO_EVAL)
    settings["schemes"] = settings.get("schemes") or DEFAULT_SCHEMES
    config = EvalConfig(**settings)
    result = run_eval(
        model, tokenizer, rotations, config, progress=not args.quiet, model_name=model_name(args.model)
    )
    t = _stage("evaluate", t, times)
    result.timings.update({f"demo {k}": v for k, v in times.items()})
    result.timings["demo total"] = time.perf_counter() - t_all
    (out / "results.json").write_text(result.to_json())
    plot_result(result, out / "results.png")
    _stage("write results", t, times)
    print()
    print(format_table(result))
    print()
    print(f"[demo] wrote {out / 'rotations.safetensors'}, {out / 'results.json'}, {out / 'results.png'}")
    print(f"[demo] total {time.perf_counter() - t_all:.1f} s")
    sys.stdout.flush()
    return 0
