"""``oscar eval MODEL --rotations FILE``: compare KV schemes on held-out text."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from . import DEFAULT_RECENT, DEFAULT_SINK

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate KV quantisation schemes (perplexity, KL, top-1, errors, passkey)",
        description=(
            "Score every scheme on the held-out part of the text under serving semantics "
            "(sink and recent windows in BF16, everything between quantised), print a table "
            "with mean ± std over sequences, and optionally write JSON and a plot."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="'smollm2' or a local Hugging Face causal-LM folder")
    p.add_argument("--rotations", metavar="FILE", help="calibrated artifact (needed by oscar2*)")
    p.add_argument("--text", metavar="PATH", help=".txt or .jsonl file (default: built-in pydoc topics)")
    p.add_argument(
        "--context", type=int, nargs="+", default=[1024, 2048], metavar="N", help="context lengths"
    )
    p.add_argument(
        "--schemes", nargs="+", metavar="NAME", help="schemes to compare (default: every built-in one)"
    )
    p.add_argument("--num-seqs", type=int, default=3, metavar="K", help="sequences per context (default 3)")
    p.add_argument("--sink", type=int, help="BF16 sink tokens (default: the artifact's, else 64)")
    p.add_argument("--recent", type=int, help="BF16 recent tokens (default: the artifact's, else 256)")
    p.add_argument("--group-size", type=int, metavar="G", help="INT2 group (default: the artifact's)")
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=1,
        metavar="C",
        help="emulate an engine with chunk-granular windows that prefills in chunks of C tokens "
        "(default 1: the per-query rule, which oscar-kernels and the engine plugins apply); "
        "also the chunk oscar2-kernels prefills with (default 256)",
    )
    p.add_argument(
        "--needle-context",
        type=int,
        nargs="*",
        default=[1024],
        metavar="N",
        help="passkey lengths ([] = off)",
    )
    p.add_argument("--needle-depths", type=float, nargs="+", default=[0.1, 0.5, 0.9], metavar="D")
    p.add_argument("--needle-trials", type=int, default=1, metavar="K", help="prompts per length and depth")
    p.add_argument("--needle-schemes", nargs="+", metavar="NAME", help="passkey schemes (default: all)")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="model dtype (default bfloat16: the serving baseline, and ~2x faster on CPUs with AVX512-BF16)",
    )
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, metavar="S")
    p.add_argument("--json", metavar="OUT", help="write the full result as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write the figure")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def run(args: argparse.Namespace) -> int:
    from oscar_math.artifact import load_rotations

    from ..evaluate import EvalConfig, format_table, run_eval
    from ..models import load_model, model_info, model_name
    from ..schemes import DEFAULT_SCHEMES
    from . import check_context, check_output_file, serving_windows

    # Output names are checked before minutes of evaluation, not after them.
    json_path = check_output_file("--json", args.json) if args.json else None
    plot_path = (
        check_output_file("--plot", args.plot, suffixes=(".png", ".pdf", ".svg")) if args.plot else None
    )
    config = EvalConfig(
        contexts=tuple(args.context),
        schemes=tuple(args.schemes or DEFAULT_SCHEMES),
        num_sequences=args.num_seqs,
        sink=args.sink if args.sink is not None else DEFAULT_SINK,  # replaced below by the served windows
        recent=args.recent if args.recent is not None else DEFAULT_RECENT,
        group_size=args.group_size,
        needle_contexts=tuple(args.needle_context or ()),
        needle_depths=tuple(args.needle_depths),
        needle_trials=args.needle_trials,
        needle_schemes=tuple(args.needle_schemes) if args.needle_schemes else None,
        seed=args.seed,
        text=args.text,
        prefill_chunk=args.prefill_chunk,
    )
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), device=device)
    info = model_info(model)
    check_context("--context", args.context, info.max_positions)
    check_context("--needle-context", args.needle_context or [], info.max_positions)
    rotations = None
    if args.rotations:  # validated against the model's geometry: a mismatch names the field
        rotations = load_rotations(
            args.rotations, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim
        )
    sink, recent = serving_windows(args.sink, args.recent, rotations)
    config = dataclasses.replace(config, sink=sink, recent=recent)
    result = run_eval(
        model, tokenizer, rotations, config, progress=not args.quiet, model_name=model_name(args.model)
    )
    print(format_table(result))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(result.to_json())
        print(f"wrote {json_path}")
    if plot_path is not None:
        from ..plot import plot_result

        print(f"wrote {plot_result(result, plot_path)}")
    sys.stdout.flush()
    return 0
