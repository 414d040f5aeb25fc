"""OSCAR with vLLM's defaults under preemption: one engine (in-process engine core, so the script
can count the scheduler's preemptions), 5 requests of PLEN prompt + GEN greedy tokens, SmolLM2.
Prints one ``RESULT`` JSON line (tokens, logprobs, preemptions, blocks); run it twice, with a KV
budget that forces preemption and a roomy one, and compare the tokens::

    PLEN=200 GEN=600 python packages/oscar-vllm/benchmarks/preemption_check.py rot.safetensors tight 51380224
    PLEN=200 GEN=600 python packages/oscar-vllm/benchmarks/preemption_check.py rot.safetensors roomy 268435456

An optional fourth argument sets ``window_records`` (``held``/``transient``) or ``off`` (prefix
caching off). A budget below one request's admission need fails at start-up (``check_admission``).
"""

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main():
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched import scheduler as sched_mod

    import oscar_vllm
    from oscar_calib.models import resolve_model
    from oscar_calib.text import load_text, split_text

    model = str(resolve_model("smollm2"))
    tok = AutoTokenizer.from_pretrained(model)
    held = split_text(load_text(None))[1]
    ids = tok(held, add_special_tokens=False)["input_ids"]
    n, plen, gen = 5, int(os.environ.get("PLEN", "900")), int(os.environ.get("GEN", "16"))
    prompts = [{"prompt_token_ids": ids[3000 + 900 * i : 3000 + 900 * i + plen]} for i in range(n)]
    count = {"preempt": 0}
    orig = sched_mod.Scheduler._preempt_request

    def counting(self, *a, **k):
        count["preempt"] += 1
        return orig(self, *a, **k)

    sched_mod.Scheduler._preempt_request = counting
    orig_sched = sched_mod.Scheduler.schedule
    steps = {"n": 0}

    def schedule(self, *a, **k):
        out = orig_sched(self, *a, **k)
        steps["n"] += 1
        if steps["n"] % 200 == 0:
            print(
                f"step {steps['n']} running {len(self.running)} waiting {len(self.waiting)} "
                f"preempted {count['preempt']} scheduled_tokens {out.total_num_scheduled_tokens} "
                f"free_blocks {self.kv_cache_manager.block_pool.get_num_free_blocks()}",
                file=sys.stderr,
                flush=True,
            )
        return out

    sched_mod.Scheduler.schedule = schedule
    which, kv = sys.argv[2], int(sys.argv[3])
    llm = LLM(
        model=model,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=n,
        kv_cache_memory_bytes=kv,
        max_num_batched_tokens=256,
        seed=0,
        **oscar_vllm.llm_kwargs(
            sys.argv[1],
            **({"window_records": sys.argv[4]} if len(sys.argv) > 4 and sys.argv[4] != "off" else {}),
        ),
        **({"enable_prefix_caching": False} if len(sys.argv) > 4 and sys.argv[4] == "off" else {}),
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=gen, logprobs=0), use_tqdm=False)
    res = {
        "which": which,
        "kv": kv,
        "preemptions": count["preempt"],
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "logprobs": [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs],
        "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
    }
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
