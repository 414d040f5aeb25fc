"""What the start-up warm-up (oscar_vllm.warmup) costs and whether serving then compiles anything.

For engine-like layer configurations (Qwen3-8B and SmolLM2 shapes, 64-token pages, vLLM's table
widths, window records as with prefix caching), with an empty Triton cache: the warm-up's wall
time and the steps it ran for real, then a random engine-like schedule (decode batches of every
size up to ``max_num_seqs``, prefills, chunks over cached tokens, mixed batches) with the launches
it made that the warm-up had not (should be none) and its wall time. The dense prefill (vLLM's
FlashAttention) is not available outside vLLM: chunks take the Triton extend path here.

Usage (repo root, GPU machine)::

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src:packages/oscar-vllm/src \\
        python3 lab/kernel_studies/warmup_cost.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="oscar-warmup-")  # before Triton loads

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "../../packages/oscar-kernels/benchmarks"))
from rope_decode_speed import with_pairs  # noqa: E402
from timing import run_meta  # noqa: E402

import oscar_kernels as ok  # noqa: E402
from oscar_kernels.launch import record_launches  # noqa: E402
from oscar_kernels.serving import WindowPages, plan_window_records, run_layer, write_window_pages  # noqa: E402
from oscar_vllm.warmup import _step_metadata, run_warmup, warmup_steps  # noqa: E402

SMOKE = "--smoke" in sys.argv  # a tiny configuration on the CPU (Triton's interpreter): the script runs
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
DEV = torch.device("cpu" if SMOKE else "cuda")
BACKEND = "triton" if SMOKE else "auto"
#: name, H_kv, GQA, d, max_num_seqs, max_num_batched_tokens, table width (tokens), pre-RoPE pairs
CONFIGS = (
    ("qwen3-8b", 8, 4, 128, 127, 8192, 131072, 8),
    ("smollm2", 3, 3, 64, 817, 8192, 4096, 4),
)
PAGE = 64
if SMOKE:
    CONFIGS = (("smoke", 2, 2, 32, 3, 40, 256, 0),)
    PAGE = 16


def layer(lo, pairs: int, num_pages: int, max_tokens: int):
    gen = torch.Generator().manual_seed(0)
    hkv, d = lo.num_kv_heads, lo.head_dim
    rk, rv = (torch.linalg.qr(torch.randn(d, d, generator=gen))[0] for _ in range(2))
    ep = ok.LayerQuantParams(rk, rv).expand(hkv, d, DEV)
    ep = with_pairs(ep, hkv, d, pairs, gen)
    buf = torch.zeros(num_pages, ok.page_bytes(lo), dtype=torch.uint8, device=DEV)
    cache = ok.cache_from_page_buffer(lo, buf, 8)
    rpp = ok.page_bytes(lo) // (2 * d)
    plan = plan_window_records(hkv, PAGE, lo.sink_tokens, lo.recent_tokens, rpp, in_flight_tokens=max_tokens)
    pages = WindowPages(buf.view(torch.bfloat16).view(num_pages, rpp, d), hkv, plan, lo.sink_tokens)
    return cache, ep, plan, pages


def served(cache, ep, plan, pages, hq, max_seqs, max_tokens, width, w_width, steps=40, seed=0) -> float:
    """An engine-like random schedule; returns its wall time (s)."""
    rng = random.Random(seed)
    lo = cache.layout
    ctx = min(3000, width * PAGE - max_tokens - 1)
    t0 = time.perf_counter()
    for i in range(steps):
        if i % 2:  # a decode batch of any size
            rows = tuple((rng.randint(1, ctx), 1) for _ in range(rng.randint(1, max_seqs)))
        else:  # prefills / chunks over cached tokens / mixed
            rows, left = [], max_tokens
            for _ in range(rng.randint(1, 4)):
                n = rng.choice([1, rng.randint(1, left)]) if left > 1 else 1
                rows.append((rng.choice([0, rng.randint(1, ctx)]), n))
                left -= n
                if left <= 0:
                    break
            rows = tuple(rows)
        md = _step_metadata(rows, width, PAGE, DEV, 8)
        t = md.num_actual_tokens
        q = torch.randn(t, hq, lo.head_dim, device=DEV).to(torch.bfloat16)
        k = torch.randn(t, lo.num_kv_heads, lo.head_dim, device=DEV).to(torch.bfloat16)
        v = torch.randn_like(k)
        run_layer(md, cache, ep, q, k, v, lo.head_dim**-0.5, BACKEND, out=torch.empty_like(q))
        tables = torch.zeros(plan.groups, len(rows), w_width, dtype=torch.int32, device=DEV)
        write_window_pages(cache, ep, k, v, md, pages, tables, BACKEND)
    sync()
    return time.perf_counter() - t0


def sync() -> None:
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="a tiny configuration on the CPU")
    a = ap.parse_args()
    results = []
    for name, hkv, g, d, max_seqs, max_tokens, width_tok, pairs in CONFIGS:
        width = width_tok // PAGE
        lo = ok.CacheLayout(hkv, d, page_size=PAGE)
        steps = warmup_steps(PAGE, lo.recent_tokens, max_tokens, max_seqs, width_tok, dense_min_query=None)
        need = max(sum(-(-(p + n) // PAGE) for p, n in s) for s in steps) + 1
        served_pages = max_seqs * (3000 // PAGE + 2) + 4 * (max_tokens + 3000) // PAGE + 8
        cache, ep, plan, pages = layer(lo, pairs, max(need, served_pages), max_tokens)
        w_width = -(-width_tok // plan.block_size)
        t0 = time.perf_counter()
        with record_launches() as warm:
            ran = run_warmup(cache, ep, hkv * g, d**-0.5, steps, width, plan, w_width, backend=BACKEND)
        sync()
        t_warm = time.perf_counter() - t0
        t_again = time.perf_counter()
        run_warmup(cache, ep, hkv * g, d**-0.5, steps, width, plan, w_width, backend=BACKEND)  # compiled
        sync()
        t_again = time.perf_counter() - t_again
        with record_launches() as seen:
            t_served = served(
                cache,
                ep,
                plan,
                pages,
                hkv * g,
                max_seqs,
                max_tokens,
                width,
                w_width,
                steps=6 if SMOKE else 40,
            )
        missing = sorted(map(str, seen - warm))
        r = dict(
            config=name, steps=len(steps), ran=ran, keys=len(warm), warmup_s=round(t_warm, 2),
            warmup_compiled_s=round(t_again, 2), served_s=round(t_served, 2), served_keys=len(seen),
            missing=len(missing), missing_examples=missing[:5],
        )  # fmt: skip
        print(json.dumps(r), flush=True)
        results.append(r)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "warmup_cost.json"), "w") as f:
        json.dump(dict(meta={} if SMOKE else run_meta(), results=results), f, indent=1)


if __name__ == "__main__":
    main()
