"""A prefix hit's short tail over a long cached prefix: the extend kernel unsplit vs split.

In vLLM on the H200 (2026-12-03 night, Qwen3-8B shape) each of 48 prefix hits on a 100k-token
prompt cost 183 ms (FA3: 33 ms): one extend program per query head reads the whole INT2 prefix.
This study times ``extend_attention`` (CUDA-graph replay) for 16-token tails over long prefixes with
``num_splits`` 1 and ``"auto"`` (and a few fixed counts), counts the INT2 bytes read, and reports
the bandwidth reached against the GPU's nominal HBM bandwidth, and the attention's FLOPs against
the tensor cores' dense BF16 peak (a 48-row hit batch is compute-bound: every row reads its own
prefix through the same dequantisation and tensor-core products).

Usage (repo root, GPU machine)::

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python3 lab/kernel_studies/extend_split.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../packages/oscar-kernels/benchmarks"))
import gpu_run as G  # noqa: E402
from timing import bench_graph_ms, run_meta  # noqa: E402

from oscar_kernels import extend_attention  # noqa: E402
from oscar_kernels.extend_attention import choose_extend_splits, extend_block_m  # noqa: E402

DEV = torch.device("cuda")
#: (prefix tokens, rows, tail tokens)
SHAPES = ((100_000, 1, 16), (100_000, 8, 16), (32_768, 8, 16), (100_000, 48, 16), (8_192, 1, 64))
#: nominal HBM TB/s and dense BF16 tensor TFLOP/s (SXM parts), by device-name substring
NOMINAL = {"H100": (3.35, 989.0), "H200": (4.8, 989.0)}


def nominal() -> tuple[float, float]:
    """``(HBM TB/s, BF16 TFLOP/s)`` of this GPU (the H200's where the name is not in the table)."""
    name = torch.cuda.get_device_name()
    return next((v for k, v in NOMINAL.items() if k in name), NOMINAL["H200"])


def rope_params(ep, hkv: int, d: int):  # noqa: ANN001, ANN201
    """``ep`` plus a pre-RoPE key mean on 8 frequency pairs (what gpu_engine.py's Qwen3-8B-shape
    artifact serves, format 3): the extend kernel adds its score term to every INT2 tile."""
    import dataclasses

    g = torch.Generator().manual_seed(1)
    m = torch.zeros(hkv, d)
    pairs = torch.arange(8)
    m[:, pairs] = torch.randn(hkv, 8, generator=g)
    m[:, pairs + d // 2] = torch.randn(hkv, 8, generator=g)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    lq = G.make_params(hkv, d, "kv_head", torch.Generator().manual_seed(2))
    return dataclasses.replace(lq, k_rope_mean=m, k_rope_inv_freq=inv).expand(hkv, d, DEV)


def case(
    prefix: int, rows: int, tail: int, rep_ms: int, block_m: int | None = None, warps: int = 4, rope: int = 0,
    block_n: int = 64, stages: int = 0, split_set: tuple = (1, "auto", 8, 32), baseline: bool = True,
) -> dict:  # fmt: skip
    s = G._int2_decode_setup(prefix + tail, rows, width=131072, gran="kv_head")
    cache, bt, ws, ep = s["cache"], s["bt"], s["ws"], s["ep"]
    if rope:
        ep = rope_params(ep, cache.layout.num_kv_heads, s["d"])
    hkv, d, g = cache.layout.num_kv_heads, s["d"], s["g"]
    t = rows * tail
    q = torch.randn(t, hkv * g, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.arange(0, t + 1, tail, dtype=torch.int32, device=DEV)
    pre = torch.full((rows,), prefix, dtype=torch.int32, device=DEV)
    host = ([tail] * rows, [prefix + tail] * rows)
    out = {"prefix": prefix, "rows": rows, "tail": tail, "int2_bytes": s["nbytes"]}
    ref = None
    bm = block_m or extend_block_m(tail, g)  # rows of a program: (token, query head) pairs of one KV head
    out["warps"], out["rope"], out["block_n"] = warps, bool(rope), block_n
    opts = {"num_stages": stages} if stages else {}  # 0: extend_attention's default
    out["stages"] = stages or None
    programs = -(-tail // (bm // g)) * rows * hkv
    out["block_m"], out["programs"] = bm, programs
    for splits in split_set:
        n = splits if splits != "auto" else choose_extend_splits(programs, prefix + tail, block_n, DEV)

        def fn(splits=splits):
            return extend_attention(
                q, k, v, cache, ep, cu, pre, bt, ws, tail, host_lens=host, num_splits=splits,
                block_m=block_m, num_warps=warps, block_n=block_n, **opts,
            )  # fmt: skip

        ms = bench_graph_ms(fn, rep_ms)
        o = fn()
        ref = o if ref is None else ref
        err = float((o.float() - ref.float()).norm() / ref.float().norm())
        out[f"ms_{splits}"] = round(ms, 4)
        out[f"splits_{splits}"] = n
        out[f"rel_vs_unsplit_{splits}"] = err
        out[f"tb_s_{splits}"] = round(s["nbytes"] / ms / 1e9, 3)
        # QKᵀ and PV over every key of every row's prefix + tail (the tail's causal half ignored)
        out[f"tflop_s_{splits}"] = round(4 * t * hkv * g * (prefix + tail) * d / ms / 1e9, 1)
    out["speedup_auto"] = round(out["ms_1"] / out["ms_auto"], 2) if "ms_1" in out else None
    if baseline:
        out.update(_bf16_baseline(rows, tail, prefix, hkv, g, d, rep_ms))
    return out


def _bf16_baseline(rows: int, tail: int, prefix: int, hkv: int, g: int, d: int, rep_ms: int) -> dict:
    """The same attention over a BF16 cache in the same run: torch's flash SDPA (contiguous K/V,
    GQA; no causal mask inside the tail, so a few FLOPs more than the real thing)."""
    try:
        n = prefix + tail
        q = torch.randn(rows, hkv * g, tail, d, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(rows, hkv, n, d, device=DEV, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        f = torch.nn.functional.scaled_dot_product_attention

        def fn():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return f(q, k, v, enable_gqa=True)

        ms = bench_graph_ms(fn, rep_ms)
        return {"ms_bf16_sdpa": round(ms, 4), "bf16_bytes": 2 * rows * hkv * n * d * 2}
    except Exception as e:  # noqa: BLE001 - a baseline that does not run says why
        return {"bf16_sdpa_error": f"{type(e).__name__}: {str(e)[:200]}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help="PREFIX,ROWS,TAIL[,BLOCK_M[,WARPS[,ROPE[,BLOCK_N[,STAGES]]]]] "
        "(BLOCK_M, STAGES 0: default; ROPE 1: RoPE mean)",
    )
    ap.add_argument("--quick", action="store_true", help="auto splits only, no BF16 baseline")
    a = ap.parse_args()
    quick = dict(split_set=("auto",), baseline=False) if a.quick else {}
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    rows = []
    for shape in shapes:
        r = case(*shape[:3], a.rep_ms, shape[3] if len(shape) > 3 and shape[3] else None, *shape[4:], **quick)
        torch.cuda.empty_cache()
        rows.append(r)
        head = f"prefix {r['prefix']:>7} x {r['rows']:>2} rows, tail {r['tail']:>3}"
        head += (
            f" (M {r['block_m']}, N {r['block_n']}, {r['warps']} warps, stages {r['stages'] or 'default'}"
            f"{', RoPE mean' if r['rope'] else ''})"
        )
        auto = f"auto ({r['splits_auto']} splits) {r['ms_auto']:.3f} ms = {r['speedup_auto']}x"
        hbm, peak = nominal()
        bw = f"{r['tb_s_auto']} TB/s of {hbm} ({r['tb_s_auto'] / hbm:.0%})"
        bw += f", {r['tflop_s_auto']} TFLOP/s of {peak:.0f} ({r['tflop_s_auto'] / peak:.0%})"
        bf = r.get("ms_bf16_sdpa")
        base = f"BF16 SDPA {bf:.3f} ms = {bf / r['ms_auto']:.2f}x" if bf else r.get("bf16_sdpa_error")
        err = r["rel_vs_unsplit_auto"]
        unsplit = f"unsplit {r['ms_1']:.3f} ms, " if "ms_1" in r else ""
        print(f"{head}: {unsplit}{auto}, {bw}; rel diff {err:.1e}; {base}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "extend_split.json"), "w") as f:
        json.dump(dict(meta=run_meta(), results=rows), f, indent=1)


if __name__ == "__main__":
    main()
