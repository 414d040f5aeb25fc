"""``oscar demo``: calibrate SmolLM2 on the built-in text, compare the main schemes, write table/JSON/plot.

Sized for 2 CPU cores: BF16, naive INT2, KIVI-2, Hadamard INT2 and OSCAR on three
held-out 2k-token sequences (perplexity, KL, KV memory). Every stage prints its wall
time and every evaluation step its time and the time left. The ablations, the
per-layer errors, the passkey test and longer contexts come from the same harness
through ``oscar eval`` (the demo prints the command).
"""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["register", "run", "DEMO_CALIBRATION", "DEMO_EVAL", "FULL_EVAL_HINT"]

#: calibration of the demo (tokens of the calibration part of the built-in text).
DEMO_CALIBRATION = {"tokens": 4096, "seq_len": 1024, "granularity": "kv_head"}
#: evaluation of the demo: the comparison a user comes for, nothing else (the full study:
#: ``oscar eval`` with its defaults, see :data:`FULL_EVAL_HINT`).
DEMO_EVAL = {
    "schemes": ("bf16", "int2", "kivi2", "hadamard2", "oscar2"),
    "contexts": (2048,),
    "num_sequences": 3,
    # the per-layer error capture roughly doubles each scheme's pass on CPU: `oscar eval` has it
    "error_sequences": 0,
    # no passkey table: SmolLM2-135M itself finds the key in only about half of 512-token
    # prompts and a third of 1024-token ones (bf16, held-out filler), so a passkey table
    # would not tell the quantisers apart
    "needle_contexts": (),
}
#: printed after the table: the same harness with every ablation, the per-layer errors,
#: the passkey test and a longer context.
FULL_EVAL_HINT = (
    "oscar eval smollm2 --rotations {out}/rotations.safetensors --context 2048 4096 --plot {out}/full.png"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="calibrate smollm2 and compare the main schemes (CPU, a few minutes)",
        description=(
            "Calibrate SmolLM2-135M on the calibration part of the built-in text, evaluate "
            "BF16, naive INT2, KIVI-2, Hadamard INT2 and OSCAR on the held-out part, print the "
            "table and write the calibrated artifact rotations.safetensors, results.json and "
            "results.png into DIR. Ablations, per-layer errors, the passkey test and longer "
            "contexts: `oscar eval` (the demo prints the command)."
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
    config = EvalConfig(**DEMO_EVAL)
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
    print(f"[demo] every ablation, per-layer errors, passkey, 4k context: {FULL_EVAL_HINT.format(out=out)}")
    sys.stdout.flush()
    return 0
