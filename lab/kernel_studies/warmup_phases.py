"""Where the start-up warm-up's time goes on a GPU: dry runs against real runs, with an empty Triton
cache and then, in a new process, with the cache the first filled (an engine's warm start), and a
third process running only the steps the first chose (``run_warmup(only=...)``, what
``oscar_vllm.warmup.WarmupPlans`` gives a warm start).

Qwen3-8B shape as vLLM serves it by default (72 slots, 8192-token steps, 131k-token tables, split
tails, window records, 8 pre-RoPE pairs); no dense prefill (vLLM's FlashAttention is not here).

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src:packages/oscar-vllm/src \\
        python3 lab/kernel_studies/warmup_phases.py --out DIR   [--smoke: CPU interpreter, tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def phase(mode: str, only_file: str | None) -> dict:
    sys.path.insert(0, os.path.dirname(__file__))
    import warmup_cost as wc  # the layer builder and configuration of the cost study

    from oscar_kernels.launch import record_launches
    from oscar_vllm import warmup as wu

    name, hkv, g, d, _, max_tokens, width_tok, pairs = wc.CONFIGS[0]
    max_seqs = 3 if wc.SMOKE else 72
    lo = wc.ok.CacheLayout(hkv, d, page_size=wc.PAGE)
    steps = wu.warmup_steps(
        wc.PAGE, lo.recent_tokens, max_tokens, max_seqs, width_tok, None, split_tails=True
    )
    need = max(sum(-(-(p + n) // wc.PAGE) - p // wc.PAGE for p, n in s) for s in steps) + 2
    cache, ep, plan, _ = wc.layer(lo, pairs, need, max_tokens)
    w_width = -(-width_tok // plan.block_size)
    width = width_tok // wc.PAGE
    times: dict[str, list] = {"dry": [], "real": []}
    # time each dry and real run: wrap run_layer through the module's own loop
    orig_run_layer = wu.run_layer

    def run_layer(md, *a, **k):
        wc.sync()
        t0 = time.perf_counter()
        r = orig_run_layer(md, *a, **k)
        wc.sync()
        from oscar_kernels.launch import _DRY

        row = (time.perf_counter() - t0, md.num_actual_tokens, len(md.seq_lens))
        times["dry" if _DRY else "real"].append(row)
        return r

    wu.run_layer = run_layer
    only = json.load(open(only_file)) if only_file else None
    t0 = time.perf_counter()
    with record_launches() as keys:
        ran = wu.run_warmup(cache, ep, hkv * g, d**-0.5, steps, width, plan, w_width,
                            backend=wc.BACKEND, extend_splits="auto", only=only)  # fmt: skip
    wc.sync()
    total = time.perf_counter() - t0
    real = sorted(times["real"], reverse=True)
    return {
        "mode": mode, "config": name, "steps": len(steps), "ran": len(ran), "keys": len(keys),
        "warmup_s": round(total, 2), "dry_s": round(sum(t for t, _, _ in times["dry"]), 2),
        "real_s": round(sum(t for t, _, _ in real), 2),
        "slowest_real": [(round(t, 3), n, b) for t, n, b in real[:8]], "chosen": ran,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--only", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=150)
    a = ap.parse_args()
    if a.phase:
        print("RESULT " + json.dumps(phase(a.phase, a.only)), flush=True)
        return
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="oscar-warmup-"))
    me = [sys.executable, __file__, *(["--smoke"] if a.smoke else [])]
    chosen = os.path.join(a.out, "warmup_chosen.json")
    results, t_end = [], time.monotonic() + a.timeout
    for mode in ("cold", "warm", "warm_only"):
        cmd = [*me, "--phase", mode, *(["--only", chosen] if mode == "warm_only" else [])]
        try:
            left = max(5, t_end - time.monotonic())
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            results.append({"mode": mode, "error": "timeout"})
            print(results[-1], flush=True)
            break
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            results.append({"mode": mode, "error": (p.stderr or p.stdout)[-1500:]})
            print(results[-1], flush=True)
            break
        r = json.loads(line[7:])
        if mode == "cold":
            json.dump(r["chosen"], open(chosen, "w"))
        r.pop("chosen")
        results.append(r)
        print(json.dumps(r), flush=True)
    json.dump(results, open(os.path.join(a.out, "warmup_phases.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
