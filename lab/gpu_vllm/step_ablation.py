"""Issue #38: what each OSCAR launch of a decode layer really adds to a step (one GPU call, ~2 min).

Profiled kernel times overlap (PDL) and the same kernel alone runs with a warm L2, so neither says
what a launch costs a step. Here a step is 36 layers, each a stand-in for the model's weight
stream (``x @ W``, W 4096 × 47,616 bf16 = 390 MB, about a Qwen3-8B layer's weights: the L2 is
flushed between two layers as in the engine) followed by OSCAR's launches of a decode layer as
vLLM runs them — the one-token write (K with error feedback and a pre-RoPE mean), the decode op
(query rotation, split kernel, merge; ``R_V`` folded: the engine's default), the window records —
all captured in one CUDA graph. Each variant drops one part; the step time it saves is that
part's cost in a step. ``overlap``: the write as ``serving.run_layer``'s ``overlap_write`` runs it
(the BF16 rows first, the INT2 rows on a second stream beside the attention and the records,
joined after them); ``deferred``: as vLLM's FULL graphs run it (the INT2 pass and the records on
the second stream, joined by the next layer; ``deferred_early``: and the query rotation beside the
window pass); ``window_pass``: its BF16 pass alone (no INT2 rows:
what folding that pass into another launch could save). A BF16 stand-in (one row written into a
BF16 cache, torch SDPA) gives a scale, not FA3's number.

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python3 lab/gpu_vllm/step_ablation.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kernel_speed as KS  # noqa: E402

import oscar_kernels as ok  # noqa: E402

LAYERS = 36
#: (context, batch, block-table width in tokens): the engine suite's rows and its tables
SHAPES = ((2048, 1, 40_000), (32_768, 8, 40_000), (130_000, 1, 131_072))
PARTS = ("weights", "write", "attention", "records")


def step_fn(parts: set[str], n: int, ctx: int, width: int):  # noqa: ANN201
    """A callable running one 36-layer step made of ``parts``."""
    dev = KS.DEV
    w = torch.randn(4096, 47_616, device=dev, dtype=torch.bfloat16) if "weights" in parts else None
    x = torch.randn(n, 4096, device=dev, dtype=torch.bfloat16)
    wcache, wparams, wplan, wargs = KS.write_setup(n)
    s = KS.G._int2_decode_setup(ctx, n, width=width)
    ep = replace(s["ep"], rotated_output=True)
    dargs = (s["q"], s["cache"], ep, s["bt"], s["sl"], s["ws"])
    out = torch.empty_like(s["q"])
    rec, _ = KS.records_setup(n)
    ok.decode_attention(*dargs, out=out)  # the validated call once (shape checks, bounds)
    lo = s["cache"].layout
    dplan = ok.plan_decode(s["cache"], s["q"].shape[1], n, s["bt"].shape[1], lo.head_dim**-0.5)
    window = ok.plan_write(wcache, wparams, n, "window", "triton")
    if "early" in parts:  # lets the query rotation start beside it (run_layer's overlap_rotation)
        window = ok.plan_write(wcache, wparams, n, "window", "triton", trigger=True)
    codes = ok.plan_write(wcache, wparams, n, "codes", "triton")
    side = torch.cuda.Stream() if dev.type == "cuda" else None

    def run() -> None:
        for i in range(LAYERS):
            if w is not None:
                torch.mm(x, w)
            if "deferred" in parts and side is not None and i:  # the layer before's pass, long done
                torch.cuda.current_stream().wait_stream(side)
            if "deferred" in parts:  # the engine's FULL-graph form: INT2 pass and records beside
                ok.run_write(window, wcache, wparams, *wargs)
                if side is None:
                    ok.run_write(codes, wcache, wparams, *wargs)
                    rec()
                else:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        ok.run_write(codes, wcache, wparams, *wargs)
                        rec()
            if "write" in parts:
                ok.run_write(wplan, wcache, wparams, *wargs)
            if "window" in parts:  # the BF16 pass alone: what a fusion into the rotation could save
                ok.run_write(window, wcache, wparams, *wargs)
            if "overlap" in parts:
                ok.run_write(window, wcache, wparams, *wargs)
                if side is None:
                    ok.run_write(codes, wcache, wparams, *wargs)
                else:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        ok.run_write(codes, wcache, wparams, *wargs)
            if "attention" in parts and "early" in parts:  # the rotation beside the window pass
                ok.run_decode(dplan, *dargs, out, after_window_pass=True)
            elif "attention" in parts:
                ok.decode_attention(*dargs, out=out, check_bounds=False)
            if "records" in parts:
                rec()
            if "overlap" in parts and side is not None:
                torch.cuda.current_stream().wait_stream(side)
        if "deferred" in parts and side is not None:  # the last layer joins
            torch.cuda.current_stream().wait_stream(side)

    return run


def bf16_fn(n: int, ctx: int):  # noqa: ANN201
    """The BF16 stand-in: weights, then a row into a BF16 cache and SDPA over it, 36 times."""
    dev = KS.DEV
    w = torch.randn(4096, 47_616, device=dev, dtype=torch.bfloat16)
    x = torch.randn(n, 4096, device=dev, dtype=torch.bfloat16)
    k = torch.randn(n, 8, ctx, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(n, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    row = torch.randn(n, 8, 1, 128, device=dev, dtype=torch.bfloat16)

    def run() -> None:
        for _ in range(LAYERS):
            torch.mm(x, w)
            k[:, :, -1:].copy_(row)
            v[:, :, -1:].copy_(row)
            torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", nargs="*", help="only these (the per-part rows then need theirs)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"meta": KS.run_meta(), "layers": LAYERS, "rows": []}
    variants = {"all": set(PARTS)} | {f"no_{p}": set(PARTS) - {p} for p in PARTS[1:]}
    variants["weights_only"] = {"weights"}
    variants["overlap"] = (set(PARTS) - {"write"}) | {"overlap"}
    variants["window_pass"] = (set(PARTS) - {"write"}) | {"window"}
    variants["deferred"] = (set(PARTS) - {"write", "records"}) | {"deferred"}
    variants["deferred_early"] = variants["deferred"] | {"early"}
    variants["attention_only"] = {"weights", "attention"}
    if a.variants:
        variants = {k: v for k, v in variants.items() if k in a.variants}
    for ctx, n, width in SHAPES:
        r = {"ctx": ctx, "batch": n, "table_tokens": width, "step_ms": {}}
        for name, parts in variants.items():
            fn = step_fn(parts, n, ctx, width)
            r["step_ms"][name] = round(KS.bench_graph_ms(fn, rep_ms=400), 4)
            del fn
            torch.cuda.empty_cache()
        if a.variants:  # the differences of the variants run
            t = r["step_ms"]
            r["us_per_layer_vs_attention_only"] = {
                k: round(1e3 * (v - t["attention_only"]) / LAYERS, 2) for k, v in t.items()
            } if "attention_only" in t else {}  # fmt: skip
            res["rows"].append(r)
            print(json.dumps(r), flush=True)
            continue
        r["step_ms"]["bf16_sdpa"] = round(KS.bench_graph_ms(bf16_fn(n, ctx), rep_ms=400), 4)
        t = r["step_ms"]
        r["us_per_layer"] = {
            p: round(1e3 * (t["all"] - t[f"no_{p}"]) / LAYERS, 2) for p in PARTS[1:]
        } | {"oscar_all": round(1e3 * (t["all"] - t["weights_only"]) / LAYERS, 2),
             "write_overlapped": round(1e3 * (t["overlap"] - t["no_write"]) / LAYERS, 2),
             "window_pass": round(1e3 * (t["window_pass"] - t["no_write"]) / LAYERS, 2),
             # the write and the records: joined in their layer / beside, joined a layer later
             "write_records_overlapped": round(1e3 * (t["overlap"] - t["attention_only"]) / LAYERS, 2),
             "write_records_deferred": round(1e3 * (t["deferred"] - t["attention_only"]) / LAYERS, 2),
             "early_rotation_saves": round(1e3 * (t["deferred"] - t["deferred_early"]) / LAYERS, 2),
             "bf16_sdpa": round(1e3 * (t["bf16_sdpa"] - t["weights_only"]) / LAYERS, 2)}  # fmt: skip
        res["rows"].append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "step_ablation.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
