"""Long-context study 4 (issue 13): error-feedback (LDLQ) rounding at write time.

Same scale, zero, clip ratios and bits as ``oscar2``; only the codes change: each row is
rounded coordinate by coordinate with the error fed forward through the ``Lᵀ D L`` factor of
the attention metric (:mod:`oscar_math.feedback`) — keys under ``M_K = R_Kᵀ C_Q R_K`` (derived
here from the artifact's rotation and eigenvalues), values under
``M_V = R_Vᵀ (Σ_{h in group} W_o,hᵀ W_o,h) R_V`` (the ``o_proj`` slices of the group's query
heads). Variants: keys only, values only, both, damping, the key clip power re-chosen under
feedback, and combined with the pre-RoPE key mean (emulation).

1. Per-layer key-logit and attention-output error (``simulate(capture=True)``) on the first
   held-out sequence of each context.
2. Selection on the calibration split (seed 1234), then held-out (seed 0) with the baselines,
   then other text — the sequences of ``long_context_study3*.py``.

::

    python lab/calib_studies/feedback_study.py --out $OUT              # calibrates (GPU)
    python lab/calib_studies/feedback_study.py --out o --artifact a.safetensors \\
        --contexts 2048 --num-seqs 2 --select-contexts --select-seqs                  # CPU, quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context_run import BASELINES, score, table  # noqa: E402
from study_common import BUILTIN_SNAPSHOT, add_split_args, start_study  # noqa: E402

from oscar_calib.calibrate import (  # noqa: E402
    KEY_CLIP_POWER_PLAIN,
    CalibrationConfig,
    calibration_chunks,
    rotations_from_statistics,
)
from oscar_calib.capture import collect_statistics  # noqa: E402
from oscar_calib.models import load_model, model_name  # noqa: E402
from oscar_calib.output_clip import output_metrics  # noqa: E402
from oscar_calib.rope_mean import RopeMeanScheme, prerope_key_means, rope_inv_freq  # noqa: E402
from oscar_calib.schemes import RowInt2Scheme, SchemeContext, build_scheme  # noqa: E402
from oscar_calib.simulate import Windows, simulate  # noqa: E402
from oscar_calib.text import split_text, token_chunks  # noqa: E402
from oscar_math.artifact import load_rotations, save_rotations  # noqa: E402
from oscar_math.bitrev import bit_reversal_permutation, permutation_matrix  # noqa: E402
from oscar_math.feedback import feedback_gain, feedback_matrix  # noqa: E402
from oscar_math.hadamard import block_hadamard  # noqa: E402


def key_metrics(rot: Any) -> list[torch.Tensor]:
    """Per layer ``[G, d, d]`` float64 ``R_Kᵀ C_Q R_K`` from the artifact (``C_Q = U Λ Uᵀ``,
    ``U = R_K H_blkᵀ P_brᵀ`` for the default composition)."""
    d, gs = rot.head_dim, rot.group_size
    hp = (permutation_matrix(bit_reversal_permutation(d, gs)) @ block_hadamard(d, gs)).double()
    out = []
    for i in range(rot.num_layers):
        r = rot.k_rotation[i].double()
        u = r @ hp.T
        c = u @ torch.diag_embed(rot.k_eigenvalues[i].double()) @ u.transpose(-1, -2)
        out.append(r.transpose(-1, -2) @ c @ r)
    return out


def value_metrics(model: Any, rot: Any, num_q_heads: int) -> list[torch.Tensor]:
    """Per layer ``[G, d, d]`` float64 ``R_Vᵀ (Σ_{h in group} W_hᵀ W_h) R_V``."""
    per_head = output_metrics(model, num_q_heads, rot.head_dim)  # [H_q, d, d]
    hkv = rot.num_kv_heads
    out = []
    for i, m in enumerate(per_head):
        m = m.double().reshape(hkv, num_q_heads // hkv, rot.head_dim, rot.head_dim).sum(1)  # [H_kv, d, d]
        if rot.v_rotation[i].shape[0] == 1:
            m = m.sum(0, keepdim=True)
        r = rot.v_rotation[i].double()
        out.append(r.transpose(-1, -2) @ m @ r)
    return out


def feedback_scheme(
    base: Any,
    name: str,
    fk: list[torch.Tensor] | None,
    fv: list[torch.Tensor] | None,
    key_clip_scale: float = 1.0,
) -> RowInt2Scheme:
    """``base`` (an ``oscar2`` scheme) with feedback codes; ``key_clip_scale`` rescales the
    exponent of the stored key ratios (stored ``α^p`` → ``α^(p·s)``)."""

    def k(i: int) -> Any:
        c = base.key_codec(i)
        clip = c.clip if c.clip is None or key_clip_scale == 1.0 else c.clip.clamp(min=1e-6) ** key_clip_scale
        return dataclasses.replace(c, feedback=None if fk is None else fk[i], clip=clip)

    def v(i: int) -> Any:
        c = base.value_codec(i)
        return dataclasses.replace(c, feedback=None if fv is None else fv[i])

    return RowInt2Scheme(name, name, base.group_size, k, v)


@torch.no_grad()
def layer_errors(model: Any, scheme: Any, ids: torch.Tensor, windows: Windows) -> dict[str, float]:
    with simulate(model, scheme, windows, capture=True) as sim:
        model.get_decoder()(input_ids=ids[None].to(next(model.parameters()).device), use_cache=False)
    lg = [e.logit_rel for e in sim.errors.values()]
    og = [e.output_rel for e in sim.errors.values()]
    return {"logit_rel_mean": statistics.fmean(lg), "output_rel_mean": statistics.fmean(og), "logit_rel": lg}


@torch.no_grad()
def served(
    model: Any, rot: Any, ctx: Any, tok: Any, text: str, contexts: list[int], windows: Windows
) -> dict:
    """Perplexity through the paged kernels (``paged_write`` with the artifact's feedback,
    ``extend_attention``, chunks of 256) vs the per-query emulation of the same artifact."""
    from oscar_calib.metrics import final_hidden, sequences_metrics
    from oscar_calib.paged import PagedConfig, PagedLM

    out = {}
    for c in contexts:
        rows = []
        for seq in token_chunks(tok, text, c, 2 * c, 0):
            ids = seq[None].to(next(model.parameters()).device)
            ref = final_hidden(model, ids)[0]
            with simulate(model, build_scheme("oscar2", ctx), windows):
                emu = final_hidden(model, ids)[0]
            lm = PagedLM(model, rot, PagedConfig(max_seqs=1, max_len=c, prefill_chunk=256))
            ker = lm.final_hidden([ids[0]])[0]
            m = sequences_metrics(model, ref, {"bf16": ref, "emu": emu, "kernels": ker}, ids[0])
            rows.append({k: v.perplexity for k, v in m.items()})
            print(
                f"served {c}: bf16 {rows[-1]['bf16']:.4f} emulation {rows[-1]['emu']:.4f} "
                f"kernels {rows[-1]['kernels']:.4f} (kernels/emulation - 1 = "
                f"{100 * (rows[-1]['kernels'] / rows[-1]['emu'] - 1):+.3f} %)",
                flush=True,
            )
        out[str(c)] = rows
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="feedback-study")
    ap.add_argument("--artifact", default=None, help="use this artifact (default: calibrate with defaults)")
    ap.add_argument("--damp", type=float, nargs="+", default=[0.01, 0.1])
    ap.add_argument(
        "--key-powers",
        type=float,
        nargs="*",
        default=[0.35, 0.5, 0.6, 0.7],
        help="key clip powers (stored ratio = searched ** p) tried with feedback keys in the selection",
    )
    ap.add_argument("--no-ropemean", action="store_true")
    add_split_args(ap)
    ap.add_argument("--errors", action="store_true", help="per-layer logit/output errors (1 seq/context)")
    ap.add_argument("--baselines", nargs="*", default=list(BASELINES))
    ap.add_argument("--only", nargs="*", default=None, help="OSCAR variants to score (default: all)")
    ap.add_argument(
        "--served",
        type=int,
        nargs="*",
        default=[],
        help="contexts at which the first 2 held-out sequences are also run through the paged INT2 "
        "kernels (PagedLM, the artifact's feedback written by paged_write) against the emulation",
    )
    ap.add_argument(
        "--confirm", nargs="*", default=None, help="OSCAR variants on held-out / other text (default: all)"
    )
    args = ap.parse_args()
    st = start_study(args.out, "fbstudy")
    out, dev, windows, report, times = st.out, st.dev, st.windows, st.report, st.times
    text, text_path = st.text, st.text_path

    def dump() -> None:
        (out / "feedback_study.json").write_text(json.dumps(report, indent=1))

    t = time.perf_counter()
    model16, tok = load_model("smollm2", dtype=torch.bfloat16, device=dev)
    need32 = args.artifact is None or not args.no_ropemean
    model32 = load_model("smollm2", dtype=torch.float32, device=dev)[0] if need32 else None
    times["load"] = time.perf_counter() - t
    cfg = CalibrationConfig(text=str(text_path))  # today's defaults: 4096-token chunks, 16384 tokens
    chunks, _ = calibration_chunks(tok, cfg)
    t = time.perf_counter()
    if args.artifact:
        rot = load_rotations(args.artifact)
        rot_kv = None
    else:
        # today's defaults (feedback on keys) plus value feedback, from one statistics pass
        stats = collect_statistics(
            model32, chunks, sink=cfg.sink, max_samples=cfg.max_samples, progress=False
        )
        cal = {"tokens": stats.tokens, "seq_len": cfg.seq_len, "text": BUILTIN_SNAPSHOT.name}
        rot_kv = rotations_from_statistics(
            stats, dataclasses.replace(cfg, feedback="kv"), model=model_name("smollm2"), calibration=cal
        )
        rot = rotations_from_statistics(stats, cfg, model=model_name("smollm2"), calibration=cal)
        save_rotations(out / "smollm2-default.safetensors", rot)
        report["default_feedback"] = rot.calibration.get("feedback")
    times["calibrate"] = time.perf_counter() - t
    hq = model16.config.num_attention_heads
    mk, mv = key_metrics(rot), value_metrics(model16, rot, hq)
    report["predicted_gain"] = {
        str(dm): {
            "k": [float(feedback_gain(m, dm).mean()) for m in mk],
            "v": [float(feedback_gain(m, dm).mean()) for m in mv],
        }
        for dm in args.damp
    }
    for dm in args.damp:
        g = report["predicted_gain"][str(dm)]
        print(
            f"damp {dm}: predicted error ratio "
            f"K {statistics.fmean(g['k']):.3f}, V {statistics.fmean(g['v']):.3f}"
        )
    fb = {
        dm: ([feedback_matrix(m, dm) for m in mk], [feedback_matrix(m, dm) for m in mv]) for dm in args.damp
    }
    hd = rot.head_dim
    ctx = SchemeContext(hd, rot.num_layers, rot.num_kv_heads, rot)
    means = None
    if not args.no_ropemean:
        t = time.perf_counter()
        means = prerope_key_means(model32, chunks, sink=cfg.sink, layers=rot.num_layers)
        times["ropemean"] = time.perf_counter() - t
    inv_freq = rope_inv_freq(model16)
    d0 = args.damp[0]

    def oscar_schemes() -> dict[str, Any]:
        # "oscar2 [artifact]" is what `oscar eval` / the engines serve from the artifact as stored;
        # "plain" the same artifact with plain rounding (the previous default's codes)
        base = build_scheme("oscar2-nofeedback", ctx)
        s: dict[str, Any] = {"plain (oscar2-nofeedback)": base}
        fk, fv = fb[d0]
        if rot.k_feedback is not None:
            s["oscar2 [artifact]"] = build_scheme("oscar2", ctx)
        s["fb K"] = feedback_scheme(base, "fb K", fk, None)
        s["fb V"] = feedback_scheme(base, "fb V", None, fv)
        s["fb KV"] = feedback_scheme(base, "fb KV", fk, fv)
        if rot_kv is not None:
            s["oscar2 [artifact, --feedback kv]"] = build_scheme(
                "oscar2", SchemeContext(hd, rot.num_layers, rot.num_kv_heads, rot_kv)
            )
        for dm in args.damp[1:]:
            s[f"fb K damp {dm}"] = feedback_scheme(base, f"fb K d{dm}", fb[dm][0], None)
        p0 = float(rot.calibration.get("clip_power", 1.0))
        s[f"previous default (plain, pK{KEY_CLIP_POWER_PLAIN})"] = feedback_scheme(
            base, "previous", None, None, KEY_CLIP_POWER_PLAIN / p0
        )
        for p in args.key_powers:
            s[f"fb K pK{p}"] = feedback_scheme(base, f"fb K pK{p}", fk, None, p / p0)
        if means is not None:
            s["ropemean (emulation)"] = RopeMeanScheme(base, means, inv_freq)
            s["ropemean + fb K (emulation)"] = RopeMeanScheme(s["fb K"], means, inv_freq)
        return s if args.only is None else {k: v for k, v in s.items() if k in args.only}

    cal_text, held_text = split_text(text)
    if args.errors:
        t = time.perf_counter()
        report["errors"] = {}
        for c in args.contexts:
            ids = token_chunks(tok, held_text, c, c, 0)[0]
            sch = oscar_schemes()
            report["errors"][str(c)] = {
                n: layer_errors(model16, sch[n], ids, windows)
                for n in (
                    "plain (oscar2-nofeedback)",
                    "oscar2 [artifact]",
                    "oscar2 [artifact, --feedback kv]",
                    "fb K",
                    "fb V",
                    "fb KV",
                )
                if n in sch
            }
            for n, e in report["errors"][str(c)].items():
                print(
                    f"errors {c}: {n:<8} logit {e['logit_rel_mean']:.4f}  output {e['output_rel_mean']:.4f}"
                )
            dump()
        times["errors"] = time.perf_counter() - t
    if args.served and rot.k_feedback is not None:
        t = time.perf_counter()
        report["served"] = served(model16, rot, ctx, tok, held_text, args.served, windows)
        times["served"] = time.perf_counter() - t
        dump()
    t = time.perf_counter()
    report["selection"] = {}
    for c, n in zip(args.select_contexts, args.select_seqs, strict=True):
        res = score(model16, oscar_schemes(), token_chunks(tok, cal_text, c, c * n, 1234), windows)
        report["selection"][str(c)] = res
        print(table(f"SELECTION (calibration split) context {c}", res), flush=True)
        dump()
    times["selection"] = time.perf_counter() - t

    # the in-format variant with the lowest mean KL on the calibration split is confirmed below
    in_format = (
        [
            k
            for k in report["selection"].get(str(args.select_contexts[0]), {}).get("schemes", {})
            if "emulation" not in k
        ]
        if args.select_contexts
        else []
    )
    if in_format:
        pick = min(
            in_format,
            key=lambda k: statistics.fmean(
                statistics.fmean(report["selection"][str(c)]["schemes"][k]["kl"])
                for c in args.select_contexts
            ),
        )
        report["pick"] = pick
        print(f"picked on the calibration split (mean KL over contexts): {pick!r}", flush=True)
        confirm = None if args.confirm is None else [*args.confirm, pick]
    else:
        confirm = args.confirm

    def full(baselines: bool) -> dict[str, Any]:
        s = {b: build_scheme(b, ctx) for b in args.baselines} if baselines else {}
        s.update({k: v for k, v in oscar_schemes().items() if confirm is None or k in confirm})
        return s

    t = time.perf_counter()
    report["heldout"] = {}
    for c, n in zip(args.contexts, args.num_seqs, strict=True):
        schemes = full(True)
        res = score(model16, schemes, token_chunks(tok, held_text, c, c * n, 0), windows)
        res["bits"] = {k: s.bits_per_element(c, hd, 64, 256) for k, s in schemes.items()}
        report["heldout"][str(c)] = res
        print(table(f"HELD-OUT built-in text, context {c}", res, res["bits"]), flush=True)
        dump()
    times["heldout"] = time.perf_counter() - t
    if args.other_contexts:
        t = time.perf_counter()
        other = st.other
        report["other"] = {}
        for c, n in zip(args.other_contexts, args.other_seqs, strict=True):
            schemes = full(True)
            res = score(model16, schemes, token_chunks(tok, other, c, c * n, 0), windows)
            res["bits"] = {k: s.bits_per_element(c, hd, 64, 256) for k, s in schemes.items()}
            report["other"][str(c)] = res
            print(table(f"OTHER TEXT, context {c}", res, res["bits"]), flush=True)
            dump()
        times["other"] = time.perf_counter() - t
    report["times"] = times
    dump()
    print("times", {k: round(v, 1) for k, v in times.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
