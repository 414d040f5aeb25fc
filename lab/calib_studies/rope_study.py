"""Long-context study 6 (issue 13): the pre-RoPE key mean in the artifact (format version 3).

INT2 key rows of position ``p`` are stored as ``Q((k − k_mean − RoPE_p(m)) @ R_K)`` and
dequantised ``+ RoPE_p(m) @ R_K`` (:mod:`oscar_math.rope_center`), ``m`` the calibrated
pre-RoPE key mean kept on ``rope_pairs`` frequency pairs per layer
(:func:`oscar_calib.calibrate.select_rope_pairs`); the static ``k_mean`` and the key clip
search are computed on the residual keys. Same bits per element as ``oscar2``.

1. One statistics pass with ``CalibrationConfig``'s defaults on the shipped Python-3.11
   snapshot (pre-RoPE key means included); every ``--variants`` artifact (``rope_pairs`` 0 =
   format version 2, today's served default; 4, 8, 16, all = format version 3) is derived
   from it, saved and loaded back, and served by ``build_scheme("oscar2", ...)`` — the path
   ``oscar eval`` and ``OscarCache`` take.
2. Selection on the calibration split (seed 1234) by mean KL over the selection contexts (the
   study-4 emulation ``RopeMeanScheme`` is scored beside, never picked), then held-out (seed 0)
   and other text with every baseline in the same run: bf16, int2, kivi2, hadamard2, the
   previous default (``rope_pairs`` 0), ``oscar2-nofeedback`` of the picked artifact, the
   picked variant and ``all``.
3. ``--served``: the picked artifact through the paged kernels (``PagedLM``) against its
   emulation, if the installed ``oscar_kernels`` serves the pre-RoPE mean (else skipped with
   the reason printed).

::

    python lab/calib_studies/rope_study.py --out $OUT/study --budget-s 200       # H200, < 5 min
    python lab/calib_studies/rope_study.py --out o --tiny                        # CPU dry run
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context_run import BASELINES, score, table  # noqa: E402
from study_common import BUILTIN_SNAPSHOT, add_split_args, start_study  # noqa: E402

from oscar_calib.calibrate import CalibrationConfig, calibration_chunks, rotations_from_statistics  # noqa: E402
from oscar_calib.capture import collect_statistics  # noqa: E402
from oscar_calib.models import load_model, model_name, tiny_random_model  # noqa: E402
from oscar_calib.rope_mean import RopeMeanScheme, rope_inv_freq  # noqa: E402
from oscar_calib.schemes import SchemeContext, build_scheme  # noqa: E402
from oscar_calib.text import split_text, token_chunks  # noqa: E402
from oscar_math.artifact import load_rotations, save_rotations  # noqa: E402

PREVIOUS = "oscar2 prev default (pairs 0)"  # names fit the tables' 30-character column
JSON = "rope_study.json"


def parse_pairs(v: str) -> int | str:
    """``"all"`` or an integer ``>= 0`` (a ``--variants`` entry)."""
    if v == "all":
        return v
    n = int(v)
    if n < 0:
        raise argparse.ArgumentTypeError(f"rope_pairs must be >= 0 or 'all', got {v!r}")
    return n


def label(pairs: int | str) -> str:
    return PREVIOUS if pairs == 0 else f"oscar2 rope_pairs {pairs}"


def nofeedback_label(name: str) -> str:
    return f"nofeedback ({name.removeprefix('oscar2 ')})"


def ablation_label(scheme: str, name: str) -> str:
    """Row label of ``--ablations`` scheme ``scheme`` built from variant ``name``'s artifact."""
    return f"{scheme.removeprefix('oscar2-')} ({name.removeprefix('oscar2 ')})"


def kernels_reason() -> str | None:
    """Why the installed ``oscar_kernels`` cannot serve a pre-RoPE key mean (None: it can).

    The score term ``q·RoPE_p(m)`` must be added by the decode and extend kernels and the
    centering done by ``paged_write``; a kernel module that never reads the compact form
    (``k_rope_*`` of :class:`oscar_kernels.params.ExpandedParams`) would serve wrong keys; a
    module that never names it is taken not to.
    """
    import importlib
    import inspect
    import re

    try:
        mods = [
            importlib.import_module(f"oscar_kernels.{m}") for m in ("decode_attention", "extend_attention")
        ]
        mods.append(importlib.import_module("oscar_kernels.paged_write"))
    except ImportError as e:
        return f"oscar_kernels not importable ({e})"
    # "rope" as a word or a name part (not inside "property")
    lacking = [m.__name__ for m in mods if not re.search(r"(?<![a-z])rope|_rope", inspect.getsource(m))]
    return f"{', '.join(lacking)} never mention the pre-RoPE mean (no score term)" if lacking else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="rope-study")
    ap.add_argument("--variants", type=parse_pairs, nargs="+", default=[0, 4, 8, 16, "all"])
    add_split_args(ap)
    ap.set_defaults(num_seqs=[8, 4, 2])
    ap.add_argument("--baselines", nargs="*", default=["bf16", *BASELINES])
    ap.add_argument("--served", type=int, nargs="*", default=[], help="contexts through the paged kernels")
    ap.add_argument(
        "--budget-s", type=float, default=1e9, help="skip the other text and --served past this wall time"
    )
    ap.add_argument("--no-emulation", action="store_true", help="skip the study-4 RopeMeanScheme row")
    ap.add_argument(
        "--ablations",
        nargs="*",
        default=[],
        help="schemes built from the picked artifact beside it in the confirmation (e.g. oscar2-noclip)",
    )
    ap.add_argument("--tiny", action="store_true", help="dry run: a 2-layer random llama on CPU")
    ap.add_argument("--tokens", type=int, default=None, help="calibration tokens (default: the config's)")
    ap.add_argument(
        "--seq-len", type=int, default=None, help="calibration chunk length (default: the config's)"
    )
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    st = start_study(args.out, "ropestudy")
    report, times = st.report, st.times
    report["variants"] = args.variants

    t = time.perf_counter()
    if args.tiny:
        model32, tok = tiny_random_model("llama", num_hidden_layers=2)
        model16, name = model32, "tiny-llama"
    else:
        model16, tok = load_model("smollm2", dtype=torch.bfloat16, device=st.dev)
        model32 = load_model("smollm2", dtype=torch.float32, device=st.dev)[0]
        name = model_name("smollm2")
    times["load"] = time.perf_counter() - t
    print(f"device {report['device']}, load {times['load']:.1f} s", flush=True)

    # 1. one statistics pass (with the pre-RoPE means), every variant derived from it
    t = time.perf_counter()
    over = {k: v for k, v in (("tokens", args.tokens), ("seq_len", args.seq_len)) if v is not None}
    cfg = CalibrationConfig(text=str(st.text_path), **over)
    chunks, _ = calibration_chunks(tok, cfg)
    inv_freq = rope_inv_freq(model32)
    stats = collect_statistics(
        model32,
        chunks,
        sink=cfg.sink,
        max_samples=cfg.max_samples,
        seed=cfg.seed,
        progress=False,
        rope_inv_freq=inv_freq,
    )
    cal = {"tokens": stats.tokens, "seq_len": cfg.seq_len, "text": BUILTIN_SNAPSHOT.name}
    ctxs: dict[str, SchemeContext] = {}
    report["artifacts"] = {}
    for pairs in dict.fromkeys(args.variants):
        rot = rotations_from_statistics(
            stats, dataclasses.replace(cfg, rope_pairs=pairs), model=name, calibration=cal
        )
        path = save_rotations(st.out / f"rope_pairs_{pairs}.safetensors", rot)
        rot = load_rotations(path)  # served from the file, as `oscar eval` does
        ctxs[label(pairs)] = SchemeContext(rot.head_dim, rot.num_layers, rot.num_kv_heads, rot)
        report["artifacts"][label(pairs)] = {
            "format_version": rot.format_version,
            "rope_mean": rot.calibration.get("rope_mean"),
            "clip_error_ratio": rot.calibration.get("clip_error_ratio"),
        }
        print(f"calibrated {label(pairs)}: format version {rot.format_version}", flush=True)
    times["calibrate"] = time.perf_counter() - t
    first = next(iter(ctxs.values()))
    hd = first.head_dim
    emulation = None
    if not args.no_emulation and PREVIOUS in ctxs:
        # study 4's emulation: the format-2 artifact, static mean replaced by RoPE_p(m) on all pairs
        means = [stats.prerope_mean[i].result("kv_head").cpu().float() for i in range(first.num_layers)]
        emulation = RopeMeanScheme(build_scheme("oscar2", ctxs[PREVIOUS]), means, inv_freq)

    def variants() -> dict[str, Any]:
        s = {k: build_scheme("oscar2", c) for k, c in ctxs.items()}
        if emulation is not None:
            s["study-4 ropemean (emulation)"] = emulation
        return s

    cal_text, held_text = split_text(st.text)
    t = time.perf_counter()
    report["selection"] = {}
    for c, n in zip(args.select_contexts, args.select_seqs, strict=True):
        res = score(model16, variants(), token_chunks(tok, cal_text, c, c * n, 1234), st.windows)
        report["selection"][str(c)] = res
        print(table(f"SELECTION (calibration split) context {c}", res), flush=True)
        st.dump(JSON)
    times["selection"] = time.perf_counter() - t

    def mean_kl(k: str) -> float:
        sel = report["selection"]
        return statistics.fmean(
            statistics.fmean(sel[str(c)]["schemes"][k]["kl"]) for c in args.select_contexts
        )

    if args.select_contexts:
        pick = min(ctxs, key=mean_kl)
        report["selection_mean_kl"] = {
            k: mean_kl(k) for k in report["selection"][str(args.select_contexts[0])]["schemes"]
        }
    else:
        pick = label("all") if label("all") in ctxs else next(iter(ctxs))
    report["pick"] = pick
    print(f"picked on the calibration split (lowest mean KL over contexts): {pick!r}", flush=True)
    confirm = [k for k in dict.fromkeys([PREVIOUS, pick, label("all")]) if k in ctxs]

    def full() -> dict[str, Any]:
        base = ctxs.get(PREVIOUS, ctxs[pick])
        s = {b: build_scheme(b, base) for b in args.baselines}
        for k in confirm:
            s[k] = build_scheme("oscar2", ctxs[k])
            if k == pick:
                s[nofeedback_label(pick)] = build_scheme("oscar2-nofeedback", ctxs[pick])
                for a in args.ablations:
                    s[ablation_label(a, pick)] = build_scheme(a, ctxs[pick])
        return s

    for part, text, cs, ns in (
        ("heldout", held_text, args.contexts, args.num_seqs),
        ("other", st.other, args.other_contexts, args.other_seqs),
    ):
        if part == "other" and time.perf_counter() - t_start > args.budget_s:
            print(f"budget: other text skipped ({time.perf_counter() - t_start:.0f} s > {args.budget_s:g} s)")
            report["skipped"] = report.get("skipped", []) + ["other"]
            break
        t = time.perf_counter()
        report[part] = {}
        for c, n in zip(cs, ns, strict=True):
            schemes = full()
            # bf16 is the reference every row is measured against: its row is exact by definition
            # (KL 0, top-1 100 %), so it is filled in rather than run a second time
            exact = {k: v for k, v in schemes.items() if v.quantized}
            res = score(model16, exact, token_chunks(tok, text, c, c * n, 0), st.windows)
            for k in (k for k, v in schemes.items() if not v.quantized):
                zeros = [0.0] * len(res["bf16_ppl"])
                res["schemes"] = {
                    k: {"kl": zeros, "dppl": zeros, "top1": [1.0] * len(zeros)},
                    **res["schemes"],
                }
            res["bits"] = {
                k: s.bits_per_element(c, hd, st.windows.sink, st.windows.recent) for k, s in schemes.items()
            }
            report[part][str(c)] = res
            print(table(f"{part.upper()} context {c}", res, res["bits"]), flush=True)
            st.dump(JSON)
        times[part] = time.perf_counter() - t
    if args.served:
        reason = kernels_reason()
        if reason is None and time.perf_counter() - t_start > args.budget_s:
            reason = f"budget ({time.perf_counter() - t_start:.0f} s > {args.budget_s:g} s)"
        if reason is None:
            from feedback_study import served

            t = time.perf_counter()
            rot = ctxs[pick].rotations
            report["served"] = served(model16, rot, ctxs[pick], tok, held_text, args.served, st.windows)
            times["served"] = time.perf_counter() - t
        else:
            print(f"served skipped: {reason}", flush=True)
            report["served_skipped"] = reason
    st.dump(JSON)
    print("times", {k: round(v, 1) for k, v in times.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
