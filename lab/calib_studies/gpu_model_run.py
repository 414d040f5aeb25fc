"""Real-model run on a CUDA machine: calibrate SmolLM2-135M, evaluate long contexts, generate.

What CPU CI cannot do in its time budget: calibration on more tokens, evaluation at
contexts up to the model's 8k, and ``model.generate`` through :class:`OscarCache` on a
GPU. Prints a table last and writes JSON under ``--out``.

    OSCAR_SMOLLM2_GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf \\
        python lab/calib_studies/gpu_model_run.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from oscar_calib.cache import OscarCache
from oscar_calib.calibrate import CalibrationConfig, calibrate
from oscar_calib.evaluate import EvalConfig, format_table, run_eval
from oscar_calib.models import load_model, model_name
from oscar_calib.schemes import DEFAULT_SCHEMES
from oscar_calib.text import builtin_text, split_text
from oscar_math.artifact import save_rotations


def _passkey_prompt(heldout: str, tokenizer, context: int, depth: float, key: str) -> str:
    ids = tokenizer(heldout)["input_ids"][: context - 64]
    cut = int(len(ids) * depth)
    before, after = tokenizer.decode(ids[:cut]), tokenizer.decode(ids[cut:])
    needle = f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
    return f"{before}{needle}{after}\nWhat is the pass key? The pass key is"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="gpu-model-run")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--num-seqs", type=int, default=4)
    ap.add_argument("--needle-contexts", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--needle-trials", type=int, default=3)
    ap.add_argument("--gen-contexts", type=int, nargs="+", default=[1024, 2048])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    times: dict[str, float] = {}
    t = time.perf_counter()
    model, tok = load_model("smollm2", dtype=torch.bfloat16, device=dev)
    times["load"] = time.perf_counter() - t
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"device {dev} ({name}), load {times['load']:.1f} s")

    t = time.perf_counter()
    calib = CalibrationConfig(tokens=args.tokens, seq_len=min(2048, args.tokens))
    rot = calibrate(model, tok, calib, model_name=model_name("smollm2"))
    times["calibrate"] = time.perf_counter() - t
    save_rotations(out / "smollm2-gpu.safetensors", rot)
    print(f"calibrated on {args.tokens} tokens in {times['calibrate']:.1f} s")

    t = time.perf_counter()
    cfg = EvalConfig(
        contexts=tuple(args.contexts),
        schemes=DEFAULT_SCHEMES,
        num_sequences=args.num_seqs,
        error_sequences=1,
        needle_contexts=tuple(args.needle_contexts),
        needle_depths=(0.1, 0.25, 0.5),
        needle_trials=args.needle_trials,
    )
    result = run_eval(model, tok, rot, cfg, model_name=model_name("smollm2"))
    times["eval"] = time.perf_counter() - t
    (out / "eval.json").write_text(result.to_json())
    print(format_table(result), flush=True)

    # generate() through the packed-INT2 OscarCache vs the plain cache, greedy
    heldout = split_text(builtin_text())[1]
    gen = []
    for context in args.gen_contexts:
        for depth in (0.1, 0.3):
            key = str(10000 + (context * 7 + int(depth * 100)) % 89999)
            prompt = _passkey_prompt(heldout, tok, context, depth, key)
            ids = tok(prompt, return_tensors="pt").to(dev)
            row = {"context": ids["input_ids"].shape[1], "depth": depth, "key": key}
            for name in ("bf16", "oscar2"):
                kw = {} if name == "bf16" else {"past_key_values": OscarCache.from_rotations(model, rot)}
                t0 = time.perf_counter()
                o = model.generate(**ids, max_new_tokens=8, do_sample=False, **kw)
                text = tok.decode(o[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
                row[name] = {"text": text, "found": key in text, "s": time.perf_counter() - t0}
                if name == "oscar2":
                    row["oscar2"]["bits_per_element"] = kw["past_key_values"].bits_per_element()
            gen.append(row)
    (out / "generate.json").write_text(json.dumps({"generate": gen, "times": times}, indent=1))
    for r in gen:
        print(
            f"passkey ctx={r['context']} depth={r['depth']}: bf16 {r['bf16']['found']} "
            f"{r['bf16']['text']!r} | oscar2 {r['oscar2']['found']} {r['oscar2']['text']!r} "
            f"({r['oscar2']['bits_per_element']:.2f} bits/elem)"
        )
    print("times", {k: round(v, 1) for k, v in times.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
