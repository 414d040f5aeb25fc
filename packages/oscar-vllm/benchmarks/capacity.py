"""vLLM's own KV capacity with its default settings, BF16 against OSCAR, at several request lengths.

Each case starts one engine in a fresh process (vLLM's defaults: prefix caching on, the default
attention backend for BF16) and reads the capacity vLLM sized (``num_gpu_blocks x block_size``
and its "Maximum concurrency" for requests of ``max_model_len`` tokens). Prints a table, writes
JSON. On vLLM's CPU build (2 cores) each engine takes ~30-60 s::

    python packages/oscar-vllm/benchmarks/capacity.py --rotations rot.safetensors \\
        --max-model-len 2048 4096 --out capacity.json

``--rotations`` may be any artifact of the model's geometry (capacity does not depend on the
calibrated values): ``oscar calibrate smollm2`` writes one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

_ONE = """
import json, sys
from vllm import LLM
import oscar_vllm
model, rotations, which, max_len, kv_bytes, seqs = sys.argv[1:7]
kw = dict(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=int(max_len),
          max_num_seqs=int(seqs), kv_cache_memory_bytes=int(kv_bytes), seed=0)
if which == "oscar":
    kw.update(oscar_vllm.llm_kwargs(rotations))
def main():
    llm = LLM(**kw)
    cc = llm.llm_engine.vllm_config.cache_config
    print("RESULT " + json.dumps({"blocks": int(cc.num_gpu_blocks), "block_size": int(cc.block_size),
                                  "prefix_caching": bool(cc.enable_prefix_caching)}))
if __name__ == "__main__":
    main()
"""


def _concurrency(log: str) -> float | None:
    for line in log.splitlines():
        if "Maximum concurrency for" in line:
            return float(line.rsplit(":", 1)[1].strip().rstrip("x").replace(",", ""))
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="model folder, or smollm2 (resolved by oscar-calib)")
    ap.add_argument("--rotations", required=True, help="an OSCAR artifact for this model")
    ap.add_argument("--max-model-len", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=512 << 20)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--out", default="capacity.json")
    args = ap.parse_args(argv)
    model = args.model
    if model == "smollm2":
        from oscar_calib.models import resolve_model

        model = str(resolve_model("smollm2"))
    rows = []
    for max_len in args.max_model_len:
        got = {}
        for which in ("bf16", "oscar"):
            cmd = [sys.executable, "-c", _ONE, model, args.rotations, which, str(max_len),
                   str(args.kv_cache_memory_bytes), str(args.max_num_seqs)]  # fmt: skip
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
            log = r.stdout + r.stderr
            res = [json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
            if r.returncode or not res:
                print(log[-3000:], file=sys.stderr)
                raise SystemExit(f"the {which} engine at max_model_len {max_len} failed ({r.returncode})")
            got[which] = {**res[0], "concurrency": _concurrency(log)}
        b, o = got["bf16"]["concurrency"], got["oscar"]["concurrency"]
        flat = {f"{k}_{w}": v for w, d in got.items() for k, v in d.items()}
        rows.append({"max_model_len": max_len, **flat, "ratio": o / b if b and o else None})
    print(f"{'request tokens':>14} {'BF16 requests':>14} {'OSCAR requests':>15} {'ratio':>7}")
    for r in rows:
        print(f"{r['max_model_len']:>14} {r['concurrency_bf16']:>14.2f} {r['concurrency_oscar']:>15.2f} "
              f"{r['ratio']:>6.2f}x")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump({"kv_cache_memory_bytes": args.kv_cache_memory_bytes, "model": model, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
