"""Long-context study 5 (issue 13): refit each INT2 group's bf16 scale and zero after the
error-feedback codes, at the same memory — measured worse; emulation only at this commit (the
format-3 writer that was measured, Triton kernel included, is commit d9ee697).

The fourth study's default writes LDLQ key codes on the clipped min/max grid. Here, with the
codes fixed, each group's (scale, zero) is refitted by weighted least squares under the same
logit metric (a 2×2 solve per group, bf16 rounding in the loop, kept only where it lowers the
weighted error), optionally re-rounded with feedback on the refitted grid and refitted again
(``refit_passes``). Same cache layout, bits and decode kernels; only the stored codes and
scale/zero change (:func:`oscar_math.feedback.quantize_int2_feedback`, ``refit_weight``).

1. One statistics pass with ``CalibrationConfig``'s defaults; variants of its artifact: the
   default (feedback codes, no refit), refit with 0 / 1 / 2 passes (weights ``w`` of
   :func:`oscar_math.feedback.feedback_factors` of ``R_Kᵀ C_Q R_K``), refit with other key clip
   powers, the de-shrunk emulations (``--deshrink``) and plain rounding (ablation).
2. Selection on the calibration split (seed 1234) by mean KL over the selection contexts, then
   held-out (seed 0) and other text with every baseline in the same run — the sequences of the
   third and fourth studies.
3. ``--served``: the artifact through the paged kernels (``PagedLM``) against its emulation
   (at d9ee697 the artifact carried the refit weights and the kernels wrote the refit).

::

    python lab/calib_studies/refit_study.py --out $OUT/study --served 8192
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
from feedback_study import key_metrics, served  # noqa: E402
from long_context_run import BASELINES, score, table  # noqa: E402
from study_common import BUILTIN_SNAPSHOT, add_split_args, start_study  # noqa: E402

from oscar_calib.calibrate import CalibrationConfig, calibration_chunks, rotations_from_statistics  # noqa: E402
from oscar_calib.capture import collect_statistics  # noqa: E402
from oscar_calib.models import load_model, model_name  # noqa: E402
from oscar_calib.schemes import KVScheme, RowInt2Scheme, SchemeContext, build_scheme  # noqa: E402
from oscar_calib.text import split_text, token_chunks  # noqa: E402
from oscar_math import dequantize_int2  # noqa: E402
from oscar_math.artifact import load_rotations, save_rotations  # noqa: E402
from oscar_math.feedback import feedback_factors  # noqa: E402

PREVIOUS = "previous default (feedback, no refit)"


def variant(
    base: Any, name: str, weights: list[torch.Tensor], passes: int, key_power: float | None = None
) -> RowInt2Scheme:
    """``base`` (``oscar2``: feedback key codes) with the key scale/zero refit (``weights[i]``,
    ``passes``) and optionally another key clip power (stored ``α^p0`` → ``α^p``); values as stored."""
    p0 = float(base_power[0])

    def k(i: int) -> Any:
        c = base.key_codec(i)
        kw: dict[str, Any] = {"refit_weight": weights[i], "refit_passes": passes}
        if key_power is not None and c.clip is not None:
            kw["clip"] = c.clip.clamp(min=1e-6) ** (key_power / p0)
        return dataclasses.replace(c, **kw)

    return RowInt2Scheme(name, name, base.group_size, k, base.value_codec)


base_power = [0.5]


class Deshrink(KVScheme):
    """*Emulation*: ``base`` with each INT2 key row's stored scale and zero multiplied by a
    per-(layer, head) factor ``κ`` (bf16-rounded after the product, as a writer would store them).

    Feedback codes — and more so the least-squares refit — shrink the decoded row towards the
    mean in the metric (``⟨x̂, x⟩_M < ⟨x, x⟩_M``), a coherent drop of every INT2 key's logits that
    softmax does not average out. ``κ = Σ xᵀMx / Σ x̂ᵀMx`` over the calibration statistics' sampled
    key rows undoes it on average."""

    def __init__(self, name: str, base: Any, kappa: list[torch.Tensor]):
        self.name, self.base, self.kappa = name, base, kappa

    def fake_quantize_keys(self, layer_idx: int, k: torch.Tensor) -> torch.Tensor:
        c = self.base.key_codec(layer_idx)
        q = c.encode(k)
        kap = self.kappa[layer_idx].to(k.device).reshape(-1, 1)  # [H, 1] against [T, H, G]
        q = dataclasses.replace(
            q,
            scale=(q.scale.float() * kap).to(torch.bfloat16),
            zero=(q.zero.float() * kap).to(torch.bfloat16),
        )
        return c.from_rotated(dequantize_int2(q), k.dtype)

    def fake_quantize_values(self, layer_idx: int, v: torch.Tensor) -> torch.Tensor:
        return self.base.fake_quantize_values(layer_idx, v)

    def bits_per_element(self, seq_len: int, head_dim: int, sink: int, recent: int) -> float:
        return self.base.bits_per_element(seq_len, head_dim, sink, recent)


def shrink_factors(scheme: Any, rot: Any, samples: list[Any]) -> tuple[list[torch.Tensor], list[float]]:
    """Per layer ``[H]`` ``κ = Σ xᵀMx / Σ x̂ᵀMx`` of ``scheme``'s key codec on sampled rows, and the
    mean slope ``1/κ`` per layer (reported)."""
    mk = key_metrics(rot)
    out, slopes = [], []
    for i, smp in enumerate(samples):
        c = scheme.key_codec(i)
        keys = smp.keys.float()
        x = c.to_rotated(keys)
        xh = dequantize_int2(c.encode(keys))
        m = mk[i].float().expand(x.shape[-2], *mk[i].shape[-2:]) if mk[i].shape[0] == 1 else mk[i].float()
        num = torch.einsum("thi,hij,thj->h", x, m, x)
        den = torch.einsum("thi,hij,thj->h", xh, m, x)
        kap = (num / den).clamp(0.9, 1.1)
        out.append(kap.cpu())
        slopes.append(float((1 / kap).mean()))
    return out, slopes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="refit-study")
    ap.add_argument("--passes", type=int, nargs="*", default=[0, 1, 2])
    ap.add_argument("--key-powers", type=float, nargs="*", default=[0.35, 0.7], help="with refit, 1 pass")
    add_split_args(ap)
    ap.add_argument("--baselines", nargs="*", default=list(BASELINES))
    ap.add_argument("--served", type=int, nargs="*", default=[])
    ap.add_argument("--deshrink", action="store_true", help="also the de-shrunk emulation variants")
    ap.add_argument("--artifact", default=None, help="a refit artifact to use (default: calibrate)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the other text past this wall time")
    args = ap.parse_args()
    t_start = time.perf_counter()
    st = start_study(args.out, "refitstudy")
    report, times = st.report, st.times

    t = time.perf_counter()
    model16, tok = load_model("smollm2", dtype=torch.bfloat16, device=st.dev)
    times["load"] = time.perf_counter() - t
    t = time.perf_counter()
    samples = None
    if args.artifact:
        rot = load_rotations(args.artifact)
        metrics = key_metrics(rot)  # R_Kᵀ C_Q R_K rebuilt from the stored eigenvalues
    else:
        model32 = load_model("smollm2", dtype=torch.float32, device=st.dev)[0]
        cfg = CalibrationConfig(text=str(st.text_path))
        chunks, _ = calibration_chunks(tok, cfg)
        stats = collect_statistics(
            model32, chunks, sink=cfg.sink, max_samples=cfg.max_samples, progress=False
        )
        cal = {"tokens": stats.tokens, "seq_len": cfg.seq_len, "text": BUILTIN_SNAPSHOT.name}
        rot = rotations_from_statistics(stats, cfg, model=model_name("smollm2"), calibration=cal)
        save_rotations(st.out / "smollm2-default.safetensors", rot)
        samples = stats.samples
        metrics = [
            r.transpose(-1, -2).double()
            @ stats.query_cov[i].result(cfg.granularity).cpu().double()
            @ r.double()
            for i, r in enumerate(rot.k_rotation)
        ]
        del model32
    times["calibrate"] = time.perf_counter() - t
    base_power[0] = float(rot.calibration.get("clip_power", 0.5))
    report["artifact"] = {"format_version": rot.format_version, "calibration": rot.calibration}
    ctx = SchemeContext(rot.head_dim, rot.num_layers, rot.num_kv_heads, rot)
    hd = rot.head_dim
    damp = float(rot.calibration.get("feedback", {}).get("damp", 0.01))
    weights = [feedback_factors(m, damp)[1] for m in metrics]

    kappas: dict[str, list[torch.Tensor]] = {}
    if samples is not None and args.deshrink:
        t = time.perf_counter()
        report["shrink_slope"] = {}
        for name, sch in (
            (PREVIOUS, build_scheme("oscar2", ctx)),
            ("refit P1", variant(build_scheme("oscar2", ctx), "refit P1", weights, 1)),
        ):
            kappas[name], report["shrink_slope"][name] = shrink_factors(sch, rot, samples)
            print(
                f"mean M-weighted slope <x^,x>/<x,x> of {name}: "
                f"{statistics.fmean(report['shrink_slope'][name]):.4f}"
            )
        times["shrink"] = time.perf_counter() - t

    def oscar_schemes() -> dict[str, Any]:
        base = build_scheme("oscar2", ctx)  # the artifact as served: feedback key codes
        s: dict[str, Any] = {
            PREVIOUS: base,
            "plain rounding (oscar2-nofeedback)": build_scheme("oscar2-nofeedback", ctx),
        }
        for p in args.passes:
            s[f"refit P{p}"] = variant(base, f"refit P{p}", weights, p)
        for kp in args.key_powers:
            s[f"refit P1 pK{kp}"] = variant(base, f"refit P1 pK{kp}", weights, 1, key_power=kp)
        if kappas:
            s["previous default + deshrink (emulation)"] = Deshrink("prev+deshrink", base, kappas[PREVIOUS])
            s["refit P1 + deshrink (emulation)"] = Deshrink(
                "refit+deshrink", variant(base, "refit P1", weights, 1), kappas["refit P1"]
            )
        return s

    cal_text, held_text = split_text(st.text)
    t = time.perf_counter()
    report["selection"] = {}
    for c, n in zip(args.select_contexts, args.select_seqs, strict=True):
        sch = {k: v for k, v in oscar_schemes().items() if not k.startswith("plain")}
        res = score(model16, sch, token_chunks(tok, cal_text, c, c * n, 1234), st.windows)
        report["selection"][str(c)] = res
        print(table(f"SELECTION (calibration split) context {c}", res), flush=True)
        st.dump("refit_study.json")
    times["selection"] = time.perf_counter() - t
    cands = list(report["selection"][str(args.select_contexts[0])]["schemes"])

    def mean_kl(k: str) -> float:
        return statistics.fmean(
            statistics.fmean(report["selection"][str(c)]["schemes"][k]["kl"]) for c in args.select_contexts
        )

    pick = min((k for k in cands if "emulation" not in k), key=mean_kl)
    report["pick"] = pick
    print(f"picked on the calibration split (lowest mean KL over contexts): {pick!r}", flush=True)
    emu = [k for k in cands if "emulation" in k]
    report["pick_emulation"] = min(emu, key=mean_kl) if emu else None
    confirm = list(
        dict.fromkeys(
            [PREVIOUS, "plain rounding (oscar2-nofeedback)", "refit P0", pick]
            + ([report["pick_emulation"]] if emu else [])
        )
    )

    def full() -> dict[str, Any]:
        s = {b: build_scheme(b, ctx) for b in args.baselines}
        s.update({k: v for k, v in oscar_schemes().items() if k in confirm})
        return s

    for part, text, cs, ns in (
        ("heldout", held_text, args.contexts, args.num_seqs),
        ("other", st.other, args.other_contexts, args.other_seqs),
    ):
        if part == "other" and time.perf_counter() - t_start > args.budget_s:
            print("budget: other text skipped", flush=True)
            break
        t = time.perf_counter()
        report[part] = {}
        for c, n in zip(cs, ns, strict=True):
            schemes = full()
            res = score(model16, schemes, token_chunks(tok, text, c, c * n, 0), st.windows)
            res["bits"] = {k: s.bits_per_element(c, hd, 64, 256) for k, s in schemes.items()}
            report[part][str(c)] = res
            print(table(f"{part.upper()} context {c}", res, res["bits"]), flush=True)
            st.dump("refit_study.json")
        times[part] = time.perf_counter() - t
    if args.served:
        t = time.perf_counter()
        report["served"] = served(model16, rot, ctx, tok, held_text, args.served, st.windows)
        times["served"] = time.perf_counter() - t
    st.dump("refit_study.json")
    print("times", {k: round(v, 1) for k, v in times.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
