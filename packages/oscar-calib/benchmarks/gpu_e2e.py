"""End-to-end GPU checks: SmolLM2-135M served through the paged INT2 kernels (H200).

Run by ``nox -s gpu`` (after the kernel unit tests) or alone; writes ``gpu_e2e.json``
under ``--out`` after every stage and exits 1 if a check fails:

1. ``calibrate``: ``oscar calibrate smollm2 --tokens 16384 --device cuda`` (same code
   path: float32 model, default config): tokens/s and peak GPU memory.
2. ``artifact``: calibration on the GPU (2048 tokens of ``data/calib-text.txt``, seq 1024,
   seed 0) vs the artifact made on CPU with the same command (``data/smollm2-cpu-2048.safetensors``).
3. ``ppl``: perplexity on held-out text at 2k and 8k, bf16 model: ``bf16`` (no
   quantisation), ``oscar2`` (the emulation, per-query windows) and ``oscar2-kernels``
   (the paged loop, prefill chunks of 256; the kernels apply the windows per query token,
   so the chunk does not change the rule) on the same sequences.
4. ``generate``: greedy tokens of the loop (3 prompts of different lengths in one batch)
   vs ``model.generate`` with :class:`OscarCache`, whose prompt is fed one token per
   ``update`` (the per-query rule; one multi-token update would read the prompt in BF16);
   free-running and teacher-forced agreement.
5. ``throughput``: decode tokens/s of the loop with the INT2 cache vs the same loop with
   plain BF16 pages (``paged_bf16_decode``), batch 1 and 8.

    OSCAR_SMOLLM2_GGUF=... python packages/oscar-calib/benchmarks/gpu_e2e.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

HERE = Path(__file__).parent
# made on CPU with: oscar calibrate smollm2 --text CALIB_TEXT --tokens 2048 --seq-len 1024 --out ...
# (a shipped text: the built-in pydoc text differs between Python versions)
CPU_ARTIFACT = HERE / "data" / "smollm2-cpu-2048.safetensors"
CALIB_TEXT = HERE / "data" / "calib-text.txt"

# Bounds (justified in docs/results.md, "GPU end to end"):
#: |ppl(kernels) / ppl(emulation) - 1|, mean over sequences, per context
PPL_BOUND = 0.02
#: teacher-forced argmax agreement, loop vs OscarCache
FORCED_AGREE = 0.9
#: artifact CPU vs GPU: relative error of eigenvalues / reconstructed covariance / key mean
ARTIFACT_REL = 1e-3
#: artifact CPU vs GPU: clip ratios (a grid search; one grid step allowed)
CLIP_ABS = 0.05


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else float("nan")


class Report:
    def __init__(self, out: Path):
        self.out, self.data, self.failures = out, {"stages": {}}, []

    def stage(self, name: str, values: dict) -> None:
        self.data["stages"][name] = values
        self.save()
        print(f"[{name}] {json.dumps(values, default=str)}", flush=True)

    def check(self, name: str, ok: bool, detail: object) -> None:
        self.data.setdefault("checks", []).append({"check": name, "pass": bool(ok), "detail": detail})
        if not ok:
            self.failures.append(name)
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        self.save()

    def save(self) -> None:
        (self.out / "gpu_e2e.json").write_text(json.dumps(self.data, indent=1, default=str))


def stage_calibrate(rep: Report, tokens: int) -> Path:
    from oscar_calib.calibrate import CalibrationConfig, calibrate
    from oscar_calib.models import load_model, model_name
    from oscar_math.artifact import save_rotations

    model, tok = load_model("smollm2", device=DEV)  # float32: the command's default
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync()
    t0 = time.perf_counter()
    rot = calibrate(
        model, tok, CalibrationConfig(tokens=tokens), model_name=model_name("smollm2"), progress=False
    )
    _sync()
    sec = time.perf_counter() - t0
    path = save_rotations(rep.out / f"smollm2-gpu-{tokens}.safetensors", rot)
    rep.stage(
        "calibrate",
        {
            "tokens": rot.calibration["tokens"],
            "seconds": sec,
            "tokens_per_s": rot.calibration["tokens"] / sec,
            "peak_gpu_mem_gib": _peak_gib(),
            "dtype": "float32",
        },
    )
    # the CPU artifact's recipe (see CPU_ARTIFACT), on the GPU; stage_artifact compares them
    t0 = time.perf_counter()
    rot2k = calibrate(
        model,
        tok,
        CalibrationConfig(tokens=2048, seq_len=1024, text=str(CALIB_TEXT)),
        model_name=model_name("smollm2"),
        progress=False,
    )
    save_rotations(rep.out / "smollm2-gpu-2048.safetensors", rot2k)
    rep.data["stages"]["calibrate"]["seconds_2048"] = time.perf_counter() - t0
    rep.save()
    del model
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return path


def stage_artifact(rep: Report, other: str | None = None) -> None:
    from oscar_math.artifact import load_rotations
    from oscar_math.rotation import compose_rotation

    cpu = load_rotations(CPU_ARTIFACT)
    gpu = load_rotations(other or rep.out / "smollm2-gpu-2048.safetensors")
    d = cpu.head_dim
    m = compose_rotation(torch.eye(d, dtype=torch.float64), cpu.group_size)  # R = U @ M
    worst = {"eig": 0.0, "cov": 0.0, "k_mean": 0.0, "clip": 0.0, "rot_max_abs": 0.0}
    for i in range(cpu.num_layers):
        a, b = cpu.for_layer(i), gpu.for_layer(i)
        for kind in ("k", "v"):
            ra, rb = getattr(a, f"{kind}_rotation").double(), getattr(b, f"{kind}_rotation").double()
            ea, eb = getattr(a, f"{kind}_eigenvalues").double(), getattr(b, f"{kind}_eigenvalues").double()
            worst["eig"] = max(worst["eig"], float(((ea - eb).abs().amax(-1) / ea.amax(-1)).max()))
            # covariance rebuilt from (R, eigenvalues): insensitive to how a near-degenerate
            # eigen-pair is split, which float noise may change
            ua, ub = ra @ m.T, rb @ m.T
            ca = ua @ torch.diag_embed(ea) @ ua.transpose(-1, -2)
            cb = ub @ torch.diag_embed(eb) @ ub.transpose(-1, -2)
            worst["cov"] = max(
                worst["cov"], float(((ca - cb).norm(dim=(-1, -2)) / ca.norm(dim=(-1, -2))).max())
            )
            worst["rot_max_abs"] = max(worst["rot_max_abs"], float((ra - rb).abs().max()))
            ca_, cb_ = getattr(a, f"{kind}_clip"), getattr(b, f"{kind}_clip")
            worst["clip"] = max(worst["clip"], float((ca_.float() - cb_.float()).abs().max()))
        if a.k_mean is not None:
            rel = (a.k_mean - b.k_mean).norm(dim=-1) / a.k_mean.norm(dim=-1)
            worst["k_mean"] = max(worst["k_mean"], float(rel.max()))
    rep.stage("artifact", worst)
    rep.check("artifact eigenvalues CPU vs GPU", worst["eig"] <= ARTIFACT_REL, worst["eig"])
    rep.check("artifact covariance (R, eigenvalues) CPU vs GPU", worst["cov"] <= ARTIFACT_REL, worst["cov"])
    rep.check("artifact key mean CPU vs GPU", worst["k_mean"] <= ARTIFACT_REL, worst["k_mean"])
    rep.check("artifact clip ratios CPU vs GPU", worst["clip"] <= CLIP_ABS, worst["clip"])


def stage_ppl(rep: Report, model, tok, rot, contexts, num_seqs: int, chunk: int) -> None:
    from oscar_calib.evaluate import EvalConfig, run_eval

    cfg = EvalConfig(
        contexts=tuple(contexts),
        schemes=("bf16", "oscar2", "oscar2-kernels"),
        num_sequences=num_seqs,
        error_sequences=0,
        needle_contexts=(),
    )  # per-query emulation; oscar2-kernels prefills in chunks of paged.KERNELS_EVAL_CHUNK
    from oscar_calib.paged import KERNELS_EVAL_CHUNK

    t0 = time.perf_counter()
    res = run_eval(model, tok, rot, cfg, progress=False, model_name="smollm2")
    out = {"seconds": time.perf_counter() - t0, "prefill_chunk": KERNELS_EVAL_CHUNK}
    for ctx, block in res.contexts.items():
        ppl = {n: e["per_sequence"]["perplexity"] for n, e in block.items()}
        ratios = [k / e - 1 for k, e in zip(ppl["oscar2-kernels"], ppl["oscar2"], strict=True)]
        out[ctx] = {
            "sequences": len(ratios),
            "ppl": {n: sum(v) / len(v) for n, v in ppl.items()},
            "ppl_per_sequence": ppl,
            "kernels_vs_emulation": ratios,
            "oscar2_vs_bf16": [o / b - 1 for o, b in zip(ppl["oscar2"], ppl["bf16"], strict=True)],
        }
        mean = sum(ratios) / len(ratios)
        rep.check(
            f"ppl kernels vs emulation @ {ctx}", abs(mean) <= PPL_BOUND, {"mean": mean, "per_seq": ratios}
        )
    rep.stage("ppl", out)


def _prompts(tok, lengths):
    from oscar_calib.text import builtin_text, split_text, tokenize

    ids = tokenize(tok, split_text(builtin_text())[1])
    # distinct starts, wrapped so that long prompts still fit in the held-out text
    starts = [(1000 + 3000 * i) % max(1, ids.numel() - n) for i, n in enumerate(lengths)]
    return [ids[s : s + n] for s, n in zip(starts, lengths, strict=True)], ids


def stage_generate(rep: Report, model, tok, rot, lengths, new: int) -> None:
    from oscar_calib.cache import OscarCache
    from oscar_calib.paged import PagedConfig, PagedLM

    prompts, _ = _prompts(tok, lengths)
    prompts = [p.to(DEV) for p in prompts]
    want, t_ref = [], 0.0
    for p in prompts:
        cache = OscarCache.from_rotations(model, rot)
        _sync()
        t0 = time.perf_counter()
        with torch.no_grad():  # one token per update: the per-query rule the loop applies
            for i in range(p.numel() - 1):
                model(p[None, i : i + 1], past_key_values=cache, use_cache=True)
        o = model.generate(
            p[None], past_key_values=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        _sync()
        t_ref += time.perf_counter() - t0
        want.append(o[0, p.numel() :].tolist())
    longest = max(lengths)
    lm = PagedLM(model, rot, PagedConfig(max_seqs=len(prompts), max_len=longest + new, prefill_chunk=longest))
    free = lm.generate(prompts, new)
    forced = lm.generate(prompts, new, forced=want)
    pos = [
        sum(a == b for a, b in zip(f, w, strict=True)) / new for f, w in zip(free.tokens, want, strict=True)
    ]
    prefix = []
    for f, w in zip(free.tokens, want, strict=True):
        n = 0
        while n < new and f[n] == w[n]:
            n += 1
        prefix.append(n)
    tf = sum(a == b for f, w in zip(forced.tokens, want, strict=True) for a, b in zip(f, w, strict=True))
    tf /= new * len(prompts)
    rep.stage(
        "generate",
        {
            "prompt_lengths": list(lengths),
            "new_tokens": new,
            "free_running_agreement": pos,
            "common_prefix": prefix,
            "teacher_forced_agreement": tf,
            "loop_tokens": free.tokens,
            "oscar_cache_tokens": want,
            "oscar_cache_generate_s": t_ref,
            "loop_generate_s": free.prefill_seconds + free.decode_seconds,
        },
    )
    rep.check("greedy teacher-forced agreement loop vs OscarCache", tf >= FORCED_AGREE, tf)
    rep.check("greedy first token loop vs OscarCache", all(n >= 1 for n in prefix), prefix)


def stage_throughput(rep: Report, model, tok, rot, batches, prompt_len: int, new: int) -> None:
    from oscar_calib.paged import PagedConfig, PagedLM

    out = {"prompt_len": prompt_len, "new_tokens": new}
    for b in batches:
        prompts, _ = _prompts(tok, [prompt_len] * b)
        prompts = [p.to(DEV) for p in prompts]
        for kv in ("int2", "bf16"):
            lm = PagedLM(
                model,
                rot if kv == "int2" else None,
                PagedConfig(max_seqs=b, max_len=prompt_len + new, prefill_chunk=1024, kv=kv),
            )
            lm.generate(prompts, 4)  # warm-up: Triton compiles
            r = lm.generate(prompts, new)
            out[f"b{b}_{kv}"] = {
                "prefill_s": r.prefill_seconds,
                "prefill_tokens_per_s": b * prompt_len / r.prefill_seconds,
                "decode_tokens_per_s": r.decode_tokens_per_second,
                "decode_ms_per_step": 1000 * r.decode_seconds / max(1, new - 1),
            }
            del lm
        rep.stage("throughput", out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-e2e"))
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--num-seqs", type=int, default=3)
    ap.add_argument(
        "--chunk",
        type=int,
        default=256,
        help="unused since the kernels apply per-token windows (kept for old command lines)",
    )
    ap.add_argument("--stages", nargs="+", default=["calibrate", "artifact", "ppl", "generate", "throughput"])
    ap.add_argument("--gen-lengths", type=int, nargs="+", default=[700, 1500, 2600])
    ap.add_argument("--gen-new", type=int, default=32)
    ap.add_argument("--tp-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tp-prompt", type=int, default=4096)
    ap.add_argument("--tp-new", type=int, default=65)
    ap.add_argument(
        "--gpu-artifact", help="stage artifact: compare this file instead of the one stage calibrate wrote"
    )
    args = ap.parse_args()
    if DEV != "cuda":
        print("gpu_e2e: no CUDA device: running on CPU (a smoke test of the script, not the GPU record)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = Report(out)
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None

    rep.data["env"] = {
        "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "commit": os.environ.get("OSCAR_COMMIT", "?"),
    }
    t_all = time.perf_counter()
    try:
        _run_stages(rep, args, out)
    except Exception as exc:  # a crash is a failed check, never a silent pass (exit 1 = failures)
        import traceback

        traceback.print_exc()
        rep.check("gpu_e2e.py ran every stage", False, f"{type(exc).__name__}: {exc}")
    rep.data["seconds"] = time.perf_counter() - t_all
    rep.save()
    print(f"gpu_e2e: {len(rep.failures)} failed checks {rep.failures} in {rep.data['seconds']:.0f} s")
    return 1 if rep.failures else 0


def _run_stages(rep: Report, args: argparse.Namespace, out: Path) -> None:
    if "calibrate" in args.stages:
        stage_calibrate(rep, args.calib_tokens)
    if "artifact" in args.stages:
        stage_artifact(rep, args.gpu_artifact)
    from oscar_calib.models import load_model
    from oscar_math.artifact import load_rotations

    model, tok = load_model("smollm2", dtype=torch.bfloat16 if DEV == "cuda" else torch.float32, device=DEV)
    gpu16k = out / f"smollm2-gpu-{args.calib_tokens}.safetensors"
    rot = load_rotations(gpu16k if gpu16k.exists() else CPU_ARTIFACT)
    rep.data["env"]["rotations"] = str(gpu16k if gpu16k.exists() else CPU_ARTIFACT)
    if "ppl" in args.stages:
        stage_ppl(rep, model, tok, rot, args.contexts, args.num_seqs, args.chunk)
    if "generate" in args.stages:
        stage_generate(rep, model, tok, rot, args.gen_lengths, args.gen_new)
    if "throughput" in args.stages:
        stage_throughput(rep, model, tok, rot, args.tp_batches, args.tp_prompt, args.tp_new)


if __name__ == "__main__":
    raise SystemExit(main())
