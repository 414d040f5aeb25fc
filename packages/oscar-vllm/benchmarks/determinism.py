"""Run-to-run reproducibility of the OSCAR engine on CPU: greedy tokens vs the step schedule.

One engine per process (SmolLM2 and the prompts of ``tests/test_engine.py``); each *phase*
sends the 6 prompts once and records the greedy tokens, their logprobs and every step's
batch (chunk length, cached prefix, window slot, first KV block of each row; the backend
appends them to ``$OSCAR_VLLM_STEP_LOG``):

* ``batch``: ``LLM.generate`` of all prompts (what the engine test does);
* ``stagger``: the first prompt alone for one step, then the others (an arrival race
  between vLLM's front end and its engine-core process, forced).

``--engine-core mp`` is vLLM's default (engine core in its own process: requests reach it
over a socket while it already runs steps); ``inproc`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(every request of ``generate`` is queued before the first step). Compare two runs with
``--compare A.json B.json``: per phase, whether the schedules and the tokens are identical.

    python determinism.py --rotations rot.safetensors --engine-core mp --phases batch --out a.json
    python determinism.py --compare a.json b.json

Needs vLLM (CPU build), oscar-calib's SmolLM2 (``OSCAR_CACHE_DIR``) and ``TRITON_INTERPRET=1``
as in the nox session ``vllm``. Findings: docs/vllm.md, "Reproducibility".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

# the engine test's settings (tests/test_engine.py)
KV_BYTES, MAX_SEQS, CHUNK = 512 << 20, 8, 64
PROMPT_LENS = (24, 120, 330, 480, 700, 900)
NEW_TOKENS = 16


def prompts() -> list[list[int]]:
    """The engine test's 6 prompts (held-out text, token ids)."""
    from transformers import AutoTokenizer

    from oscar_calib.models import resolve_model
    from oscar_calib.text import load_text, split_text

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2")))
    held = split_text(load_text(None))[1]
    ids = tok(held, add_special_tokens=False)["input_ids"]
    return [ids[5000 + 1000 * i : 5000 + 1000 * i + n] for i, n in enumerate(PROMPT_LENS)]


def _result(out) -> dict:
    c = out.outputs[0]
    lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids, strict=True)]
    return {"tokens": list(c.token_ids), "logprobs": lps}


def _phase(llm, kind: str, ps: list[list[int]], log: Path) -> dict:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0)
    start = log.stat().st_size if log.exists() else 0
    if kind == "batch":
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
        res = [_result(o) for o in outs]
    elif kind == "stagger":
        eng, done, tag = llm.llm_engine, {}, f"s{start}-"
        eng.add_request(f"{tag}0", {"prompt_token_ids": ps[0]}, sp)
        first = True
        while eng.has_unfinished_requests() or first:
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
            if first:
                for i, p in enumerate(ps[1:], 1):
                    eng.add_request(f"{tag}{i}", {"prompt_token_ids": p}, sp)
                first = False
        res = [_result(done[f"{tag}{i}"]) for i in range(len(ps))]
    else:
        raise SystemExit(f"unknown phase {kind!r} (batch, stagger)")
    with open(log) as f:
        f.seek(start)
        steps = [json.loads(line) for line in f]
    return {"phase": kind, "results": res, "steps": steps}


def run(args: argparse.Namespace) -> dict:
    if args.engine_core == "inproc":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    log = Path(tempfile.mkdtemp()) / "steps.jsonl"
    log.touch()  # stays empty with --backend bf16 (vLLM's own builder logs nothing)
    os.environ["OSCAR_VLLM_STEP_LOG"] = str(log)  # inherited by the engine-core process
    from vllm import LLM

    from oscar_calib.models import resolve_model

    extra = {}
    if args.backend == "oscar":
        import oscar_vllm

        extra = oscar_vllm.llm_kwargs(args.rotations)
    llm = LLM(
        model=str(resolve_model("smollm2")),
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=MAX_SEQS,
        max_num_batched_tokens=CHUNK,
        kv_cache_memory_bytes=KV_BYTES,
        seed=0,
        **extra,
    )
    ps = prompts()
    phases = [_phase(llm, k, ps, log) for k in args.phases.split(",")]
    return {"backend": args.backend, "engine_core": args.engine_core, "phases": phases}


def schedule(steps: list[dict]) -> list[list[tuple[int, int]]]:
    """Per step, the (cached prefix, chunk length) of every row: the chunking, without slots
    and blocks (which differ between runs and must not matter)."""
    return [sorted(zip(s["prefix_lens"], s["query_lens"], strict=True)) for s in steps]


def chunks_per_prompt(steps: list[dict]) -> list[list[tuple[int, int]]]:
    """Each request's own chunks, (cached prefix, chunk length) per step, in arrival order
    (a request is known by its first KV block while it lives; requests start in order)."""
    seqs: list[list[tuple[int, int]]] = []
    live: dict[int, int] = {}
    for s in steps:
        for q, p, b in zip(s["query_lens"], s["prefix_lens"], s["first_blocks"], strict=True):
            if p == 0:
                live[b] = len(seqs)
                seqs.append([])
            seqs[live[b]].append((p, q))
    return seqs


def compare(a: dict, b: dict) -> list[str]:
    lines = []
    for i, (pa, pb) in enumerate(zip(a["phases"], b["phases"], strict=False)):
        same_sched = schedule(pa["steps"]) == schedule(pb["steps"])
        toks = [x["tokens"] == y["tokens"] for x, y in zip(pa["results"], pb["results"], strict=True)]
        lps = [x["logprobs"] == y["logprobs"] for x, y in zip(pa["results"], pb["results"], strict=True)]
        first = [s["query_lens"] for s in pa["steps"][:2]], [s["query_lens"] for s in pb["steps"][:2]]
        own = [
            x == y
            for x, y in zip(chunks_per_prompt(pa["steps"]), chunks_per_prompt(pb["steps"]), strict=True)
        ]
        lines.append(
            f"phase {i} ({pa['phase']} vs {pb['phase']}): same schedule {same_sched}, "
            f"same chunks per prompt {own} "
            f"(first steps' chunks {first[0]} vs {first[1]}); same tokens per prompt {toks}; "
            f"same logprobs per prompt {lps}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rotations")
    ap.add_argument("--backend", choices=("oscar", "bf16"), default="oscar")
    ap.add_argument("--engine-core", choices=("mp", "inproc"), default="mp")
    ap.add_argument("--phases", default="batch")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar="JSON")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        print("\n".join(compare(a, b)))
        return
    if args.backend == "oscar" and not args.rotations:
        sys.exit("--rotations is required with --backend oscar")
    res = run(args)
    text = json.dumps(res)
    if args.out:
        Path(args.out).write_text(text)
    for p in res["phases"]:
        print(p["phase"], [r["tokens"] for r in p["results"]])


if __name__ == "__main__":
    main()
