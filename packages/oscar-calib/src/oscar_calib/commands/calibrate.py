"""``oscar calibrate MODEL --out FILE``: calibrate rotations, key means and clip ratios."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from . import DEFAULT_RECENT, DEFAULT_SINK

__all__ = ["register", "run"]


def _rope_pairs(v: str) -> int | str:
    if v == "all":
        return v
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0 or 'all', got {v!r}")
    return n


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="calibrate OSCAR rotations for a model and write the artifact",
        description=(
            "Stream calibration text through MODEL, derive per-layer key/value rotations, "
            "key means and clip ratios, and write one .safetensors artifact. The text is "
            "split into a calibration part and a held-out part; only the calibration part is used."
        ),
    )
    p.add_argument("model", metavar="MODEL", help="'smollm2' or a local Hugging Face causal-LM folder")
    p.add_argument("--out", required=True, metavar="FILE", help="artifact to write (.safetensors)")
    p.add_argument(
        "--tokens", type=int, default=16384, metavar="N", help="calibration tokens (default 16384)"
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        metavar="L",
        help="tokens per chunk (default 4096, or the model's context if shorter)",
    )
    p.add_argument("--text", metavar="PATH", help=".txt or .jsonl file (default: built-in pydoc topics)")
    p.add_argument("--granularity", choices=("kv_head", "layer"), default="kv_head")
    p.add_argument("--group-size", type=int, metavar="G", help="quantisation group (default: head dim)")
    p.add_argument("--seed", type=int, default=0, metavar="S")
    p.add_argument(
        "--sink", type=int, default=DEFAULT_SINK, help=f"BF16 sink tokens (default {DEFAULT_SINK})"
    )
    p.add_argument(
        "--recent", type=int, default=DEFAULT_RECENT, help=f"BF16 recent tokens (default {DEFAULT_RECENT})"
    )
    p.add_argument("--no-key-centering", action="store_true", help="do not subtract a key mean")
    p.add_argument("--no-clip", action="store_true", help="store clip ratio 1.0 (no clipping)")
    p.add_argument(
        "--clip-power",
        type=float,
        default=None,
        metavar="P",
        help="stored key clip ratio = searched ** P (default 0.7; 1 = as searched)",
    )
    p.add_argument(
        "--key-clip-objective",
        choices=("logit", "attention"),
        default=None,
        help="key clip search: every sampled row alike (logit, default) or weighted by received attention",
    )
    p.add_argument(
        "--value-clip-power",
        type=float,
        default=None,
        metavar="P",
        help="the same for values (default 0.5)",
    )
    p.add_argument(
        "--clip-search",
        choices=("output", "row", "kl"),
        default=None,
        help="row (default): store the tempered row-search ratios (searched ** P); kl: one key and "
        "one value power per block of layers, chosen by the model's KL through the emulated cache on "
        "long calibration sequences; output: refine each KV head's ratios by its attention-output error",
    )
    p.add_argument(
        "--power-blocks",
        type=int,
        default=None,
        metavar="N",
        help="layer blocks of the kl search, one key and one value power each (default 6)",
    )
    p.add_argument(
        "--search-context",
        type=int,
        default=None,
        metavar="N",
        help="tokens per sequence of the output or kl search (default 8192, at most the model's context)",
    )
    p.add_argument(
        "--search-seqs",
        type=int,
        default=None,
        metavar="N",
        help="sequences of the output or kl search (default 2)",
    )
    p.add_argument(
        "--search-weighting",
        choices=("o_proj", "fisher"),
        default=None,
        help="output search's error: through o_proj (default) or the empirical Fisher (loss gradient)",
    )
    p.add_argument(
        "--feedback",
        choices=("none", "k", "v", "kv"),
        default=None,
        help="rows written with error-feedback (LDLQ) codes under the attention metric (default k; "
        "stored in the artifact, format version 2; none writes a version-1 artifact)",
    )
    p.add_argument(
        "--rope-pairs",
        type=_rope_pairs,
        default=None,
        metavar="R",
        help="centre INT2 keys per position by the pre-RoPE key mean on R frequency pairs per layer "
        "(the R with the most query-weighted mean energy a static mean cannot remove), 'all', or 0 "
        "(off: format version 1/2); default: oscar_calib.calibrate.ROPE_PAIRS_DEFAULT (format version 3)",
    )
    p.add_argument("--device", default="cpu", help="torch device for the model (default cpu)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from oscar_math.artifact import save_rotations

    from ..calibrate import CalibrationConfig, calibrate
    from ..models import load_model, model_info, model_name
    from . import check_context, check_output_file

    out = check_output_file("--out", args.out)  # before the expensive pass, not after it
    # the default chunk length never asks for more than the tokens (nor, below, the model's context)
    default_len = CalibrationConfig.seq_len
    # (too few tokens for one chunk past the sink still fail, on --tokens)
    seq_len = args.seq_len if args.seq_len is not None else min(default_len, max(args.tokens, args.sink + 1))
    config = CalibrationConfig(
        tokens=args.tokens,
        seq_len=seq_len,
        granularity=args.granularity,
        group_size=args.group_size,
        seed=args.seed,
        text=args.text,
        sink=args.sink,
        recent=args.recent,
        key_centering=not args.no_key_centering,
        clip=not args.no_clip,
        **{
            name: getattr(args, name)
            for name in (
                "clip_power",
                "value_clip_power",
                "key_clip_objective",
                "clip_search",
                "search_context",
                "search_seqs",
                "search_weighting",
                "power_blocks",
                "feedback",
                "rope_pairs",
            )
            if getattr(args, name) is not None
        },
    )
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device)
    max_positions = model_info(model).max_positions
    if args.seq_len is None and max_positions and config.seq_len > max_positions:
        config = dataclasses.replace(config, seq_len=max_positions)
    check_context("--seq-len", [config.seq_len], max_positions)
    rotations = calibrate(
        model, tokenizer, config, model_name=model_name(args.model), progress=not args.quiet
    )
    path = save_rotations(out, rotations)
    seconds = time.perf_counter() - start
    cal = rotations.calibration
    k_clip = sum(float(c.mean()) for c in rotations.k_clip) / rotations.num_layers
    v_clip = sum(float(c.mean()) for c in rotations.v_clip) / rotations.num_layers
    print(
        f"wrote {path}: {rotations.model}, {rotations.num_layers} layers x {rotations.num_groups} "
        f"rotation(s), head dim {rotations.head_dim}, group {rotations.group_size}"
    )
    print(
        f"calibrated on {cal['tokens']} tokens ({cal['chunks']} x {cal['seq_len']}) of {cal['text']}, "
        f"seed {cal['seed']}, in {seconds:.1f} s"
    )
    if config.clip and "output_error_ratio" in cal:
        ratio = cal["output_error_ratio"]
        print(
            f"clip ratios: K mean {k_clip:.3f}, V mean {v_clip:.3f} (output search on "
            f"{cal['clip_search']['sequences']} x {cal['clip_search']['tokens_per_sequence']} tokens: "
            f"attention-output error x{ratio['chosen_vs_row_search']:.2f} of the row search's ratios, "
            f"x{ratio['chosen_vs_unclipped']:.2f} of no clipping)"
        )
    elif config.clip and "clip_power_per_layer" in cal:
        search = cal["clip_search"]
        print(
            f"clip ratios: K mean {k_clip:.3f}, V mean {v_clip:.3f} (KL search over {search['blocks']} "
            f"layer blocks on {search['sequences']} x {search['tokens_per_sequence']} tokens: mean KL "
            f"{search['kl_start']:.4f} -> {search['kl_chosen']:.4f}; key powers "
            f"{sorted(set(cal['clip_power_per_layer']['k']))}, value powers "
            f"{sorted(set(cal['clip_power_per_layer']['v']))})"
        )
    elif config.clip:
        ratio = cal.get("clip_error_ratio", {})
        print(
            f"clip ratios: K mean {k_clip:.3f}, V mean {v_clip:.3f} "
            f"(calibration error vs no clipping: K x{ratio.get('k', float('nan')):.2f}, "
            f"V x{ratio.get('v', float('nan')):.2f})"
        )
    if rotations.has_feedback:
        print(
            f"error-feedback codes for {cal['feedback']['rows'].upper()} rows "
            f"(format version {rotations.format_version}; damp {cal['feedback']['damp']:g})"
        )
    if rotations.has_rope_mean:
        rope = cal.get("rope_mean", {})
        pairs = [int((m[:, : m.shape[1] // 2] != 0).any(0).sum()) for m in rotations.k_rope_mean]
        print(
            f"pre-RoPE key mean on {min(pairs)}-{max(pairs)} of {rotations.head_dim // 2} frequency pairs "
            f"per layer (rope_pairs {rope.get('rope_pairs')}; format version {rotations.format_version})"
        )
    sys.stdout.flush()
    return 0
