"""CPU throughput of vLLM with OSCAR vs BF16 on SmolLM2 (no target on CPU: the torch references run there).

    python packages/oscar-vllm/benchmarks/cpu_throughput.py --rotations rot.safetensors [--backend oscar|bf16]

Runs one engine per invocation (run it twice), a batch of ``--batch`` prompts of
``--prompt`` tokens, ``--new`` greedy tokens each; prints prefill + decode wall time
(prefill of the batch alone, then prefill + generation) and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("oscar", "bf16"), default="oscar")
    ap.add_argument("--rotations")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument(
        "--prefix-caching",
        action="store_true",
        help="caching on (OSCAR: window pages written and restored every step); fresh prompts per call",
    )
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    from oscar_calib.models import resolve_model

    extra = {}
    if args.backend == "oscar":
        import oscar_vllm

        extra = oscar_vllm.llm_kwargs(args.rotations)
    llm = LLM(
        model=str(resolve_model(args.model)),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=8,
        kv_cache_memory_bytes=512 << 20,
        # without the flag the timed calls repeat the prompts: no reuse for either backend
        enable_prefix_caching=args.prefix_caching,
        **extra,
    )

    def batch(call: int) -> list[dict]:
        # with caching on, each call gets its own prompts (nothing to reuse)
        k = call * args.batch if args.prefix_caching else 0
        return [
            {"prompt_token_ids": [(17 * (i + k) + 31 * j) % 20000 + 100 for j in range(args.prompt)]}
            for i in range(args.batch)
        ]

    llm.generate(batch(2)[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    llm.generate(batch(0), SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t1 = time.perf_counter()
    out = llm.generate(
        batch(1), SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True), use_tqdm=False
    )
    t2 = time.perf_counter()
    gen = sum(len(o.outputs[0].token_ids) for o in out)
    print(json.dumps({
        "backend": args.backend, "prefix_caching": args.prefix_caching,
        "batch": args.batch, "prompt": args.prompt, "new": args.new,
        "prefill_s": round(t1 - t0, 2), "prefill_tok_per_s": round(args.batch * args.prompt / (t1 - t0), 1),
        "generate_s": round(t2 - t1, 2), "generated_tok_per_s": round(gen / (t2 - t1), 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
