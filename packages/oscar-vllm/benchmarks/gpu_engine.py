"""vLLM with OSCAR on a GPU, beside vLLM's own BF16 backends in the same run: correctness,
KV capacity and speed, each engine in its own process.

    python gpu_engine.py suite --out DIR [--only NAME,...] [--qwen CONFIG_DIR] [--smol MODEL_DIR]
    python gpu_engine.py case '{"name": ..., ...}'        # one engine (what the suite runs)

The suite prints one table and writes ``DIR/gpu_engine.json`` (every case's result, vLLM's
capacity lines, errors) and ``DIR/gpu_engine.log`` (the tail of every case's log). Models:
``--qwen`` a folder with the Qwen3-8B-shaped ``config.json`` (dummy weights), ``--smol`` the
real SmolLM2-135M folder (converted by ``oscar_calib.models``; its artifact is calibrated on
the GPU by ``oscar calibrate``). ``--tp 2`` runs the Qwen3 cases with tensor parallelism.

Workloads (random token ids, distinct per run unless said otherwise; greedy, ``ignore_eos``):

* ``capacity``: vLLM's own ``KV cache size`` and ``Maximum concurrency`` lines.
* ``decode CTX BATCH GEN``: ``BATCH`` prompts of ``CTX`` tokens generating ``GEN`` tokens, and
  other prompts of the same shape generating 1; decode tokens/s = ``BATCH·(GEN-1) / (t_GEN - t_1)``,
  prefill time = ``t_1``.
* ``shared CTX BATCH GEN``: one ``CTX``-token prefix computed once, then ``BATCH`` requests of
  that prefix + 16 own tokens (prefix-cache hits) — decode at a batch no backend could prefill
  within the device budget; every backend gets the same treatment.
* ``greedy``: token ids of fixed prompts (compared across cases by the suite).
* ``ppl``: prompt-logprob perplexity of fixed text windows (real weights only).
* ``repeat``: a prompt twice (the second a prefix-cache hit) and its continuation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

from stack_sampler import StackSampler  # this folder (the script runs from here)

RESULT = "RESULT "
PARTIAL = "PARTIAL "
CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")
CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")
GRAPH_LINE = re.compile(r"Capturing CUDA graphs|cudagraph_mode|CUDAGraphMode|Graph capturing finished")
QWEN_LAYERS = 36
# where a start's time goes (vLLM's own timing lines and OSCAR's warm-up line), with their clock
START_LINE = re.compile(
    r"took|takes|finished in|warmed up|Dynamo bytecode transform|Compiling a graph|init engine|prefill chunks"
)
OSCAR_SEQS = re.compile(r"OSCAR: max_num_seqs defaults to (\d+)")


# ---- one engine (runs in its own process) ---------------------------------------------------


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def _timed(llm, prompts: list[list[int]], sp) -> tuple[float, list]:  # noqa: ANN001
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return time.perf_counter() - t, out


def _stepped(llm, prompts: list[list[int]], sp, tag: str, profile_steps: int = 6) -> dict:  # noqa: ANN001
    """One pass through the engine's step loop: prefill time (until every request has its first
    token) and decode tokens/s over the steps where every request decodes (median step time too),
    so neither a second prefill nor a one-time kernel compile is subtracted from the decode."""
    eng = llm.llm_engine
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, pr in zip(ids, prompts, strict=True):
        eng.add_request(rid, {"prompt_token_ids": pr}, sp)
    got = dict.fromkeys(ids, 0)
    t0 = time.perf_counter()
    marks: list[tuple[float, int, int]] = []
    gpu: dict = {}
    while eng.has_unfinished_requests():
        if profile_steps and not gpu and min(got.values()) >= sp.max_tokens - profile_steps - 2:
            # the last few steps under the profiler (after the timed ones): device time per kernel
            gpu = _gpu_kernels(eng, profile_steps, got)
            break
        for o in eng.step():
            if o.request_id in got:
                got[o.request_id] = len(o.outputs[0].token_ids)
        marks.append((time.perf_counter(), min(got.values()), sum(got.values())))
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id in got:
                got[o.request_id] = len(o.outputs[0].token_ids)
    first = next((m for m in marks if m[1] >= 1), marks[-1])
    out = dict(t_prefill=round(first[0] - t0, 3), t_total=round(marks[-1][0] - t0, 3), steps=len(marks))
    rate = full_batch_rate([(t0, 0, 0), *marks], len(prompts))
    if rate:
        out.update(rate, all_tokens=all(n == sp.max_tokens for n in got.values()))
    if gpu:
        out["gpu"] = gpu
    return out


def full_batch_rate(marks: list[tuple[float, int, int]], batch: int) -> dict:
    """Decode speed over the steps in which every one of ``batch`` requests got a token: ``marks``
    are ``(time, fewest tokens of a request, tokens in all)`` after each step, the first one the
    start. Steps that began before every request had its first token (they prefilled) or ran
    after one finished (fewer than ``batch`` tokens) are left out: with long prompts prefilled one
    after another, the first requests can finish before the last one starts, and counting those
    steps measured a fraction of the batch (the H100's 100k maxdecode, 2026-12-07). ``{}`` when no
    such step ran."""
    steps = zip(marks, marks[1:], strict=False)
    full = [(b[0] - a[0]) for a, b in steps if a[1] >= 1 and b[2] - a[2] == batch]
    if len(full) < 2:
        return {}
    span = sum(full)
    return dict(
        decode_tok_s=round(batch * len(full) / max(span, 1e-9), 1),
        median_step_ms=round(1e3 * sorted(full)[len(full) // 2], 2),
        full_steps=len(full),
    )


def maxdecode_tokens(gen: int, batch: int, ctx: int, step_tokens: int) -> int:
    """Tokens each request of a maxdecode batch generates so that ``gen`` steps run with all
    ``batch`` of them decoding: the engine prefills at most ``step_tokens`` prompt tokens a step,
    and the first requests decode through the ``ceil(batch · ctx / step_tokens)`` steps the others'
    prompts take (plus two: the step that ends a prompt also samples its first token)."""
    return gen + -(-batch * ctx // max(step_tokens, 1)) + 2


def maxdecode_plan(
    cache_tokens: int, ctx: int, gen: int, block: int, max_seqs: int, step_tokens: int,
    prefill: int | None = None,
):  # fmt: skip
    """``(batch, tokens each generates)`` of a maxdecode run: the largest batch whose requests,
    each generating :func:`maxdecode_tokens` for that batch, fit ``cache_tokens`` at once.
    ``prefill``: prompt tokens each request computes in the timed pass (default ``ctx``; with the
    prefix cache filled by a first pass, at most one block)."""
    batch = max_batch(cache_tokens, ctx, gen, block, max_seqs)
    while True:  # a smaller batch needs fewer extra tokens: the batch only shrinks, so this ends
        n_gen = maxdecode_tokens(gen, batch, ctx if prefill is None else prefill, step_tokens)
        fits = max_batch(cache_tokens, ctx, n_gen, block, max_seqs)
        if fits >= batch or batch == 1:
            return batch, n_gen
        batch = fits


def _gpu_kernels(eng, steps: int | None, got: dict | None = None) -> dict:  # noqa: ANN001
    """``steps`` decode steps under the torch profiler: device time per step by kernel (CUPTI sees
    kernels inside CUDA-graph replays), the top 20 and the total, and the wall time per step."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        n = 0
        while ((n < steps) if steps else True) and eng.has_unfinished_requests():  # None: until done
            for o in eng.step():
                if got is not None and o.request_id in got:
                    got[o.request_id] = len(o.outputs[0].token_ids)
            n += 1
        torch.cuda.synchronize()
    steps = max(n, 1)
    wall = time.perf_counter() - t0
    from torch.autograd import DeviceType

    # kernels only: an aten op also reports its kernels' device time (counted twice otherwise)
    ev = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    ev.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in ev)
    return dict(
        steps=steps,
        wall_ms_per_step=round(1e3 * wall / steps, 2),
        device_ms_per_step=round(total / 1e3 / steps, 3),
        top=[(e.key[:70], e.count // steps, round(e.self_device_time_total / steps, 1)) for e in ev[:25]],
    )


def _start_decoding(llm, prompts: list[list[int]], sp, tag: str):  # noqa: ANN001, ANN202
    """Add ``prompts`` and step the engine until every request decodes; returns the engine."""
    eng = llm.llm_engine
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, pr in zip(ids, prompts, strict=True):
        eng.add_request(rid, {"prompt_token_ids": pr}, sp)
    got = dict.fromkeys(ids, 0)
    while min(got.values()) < 2 and eng.has_unfinished_requests():  # every request decoding
        for o in eng.step():
            if o.request_id in got:
                got[o.request_id] = len(o.outputs[0].token_ids)
    return eng


def _profile_decode(llm, prompts: list[list[int]], sp, tag: str, steps: int) -> dict:  # noqa: ANN001
    """Prefill ``prompts``, then ``steps`` pure decode steps under the torch profiler: whether the
    step replays a CUDA graph (``cudaGraphLaunch``) or launches OSCAR's kernels one by one, the
    host time per step and the top host ops (the per-layer host cost, when attention runs eagerly)."""
    import torch

    eng = _start_decoding(llm, prompts, sp, tag)
    cuda = torch.cuda.is_available()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    while eng.has_unfinished_requests():
        eng.step()
    ev = prof.key_averages()
    count = {e.key: e.count for e in ev}
    top = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    return dict(
        steps=steps,
        ms_per_step=round(1e3 * wall / steps, 2),
        graph_launches=count.get("cudaGraphLaunch", 0),
        # launches from the host per step: hundreds when attention runs eagerly, a few under FULL graphs
        host_launches_per_step=(count.get("cudaLaunchKernel", 0) + count.get("cuLaunchKernel", 0)) // steps,
        # Triton kernels by name (counted on the device in and out of graphs)
        triton_kernels={k[:50]: v // steps for k, v in count.items() if k.endswith("_kernel")},
        top_cpu=[(e.key[:60], e.count, round(e.self_cpu_time_total / 1e3 / steps, 3)) for e in top],
    )


def _py_profile(llm, prompts: list[list[int]], sp, tag: str, steps: int) -> dict:  # noqa: ANN001
    """Prefill ``prompts``, then ``steps`` decode steps under cProfile (engine core in-process): the
    Python functions that make up an eager step's host time, by own time and by cumulative time."""
    eng = _start_decoding(llm, prompts, sp, tag)

    def run() -> int:
        for _ in range(steps):
            eng.step()
        return steps

    out = _cprofile(run)
    while eng.has_unfinished_requests():
        eng.step()
    return out


def _cprofile(run) -> dict:  # noqa: ANN001
    """``run()`` (returns how many steps it ran) under cProfile: Python functions by own and by
    cumulative time, ms a step, the 40 largest of each (``oscar_cum_ms``: OSCAR's own files)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    steps = max(run(), 1)
    prof.disable()
    wall = time.perf_counter() - t0
    st = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tt, ct, callers)}

    def name(k: tuple) -> str:
        f, line, fn = k
        return f"{'/'.join(f.split('/')[-2:])}:{line}:{fn}"[-90:]

    rows = [
        (name(k), v[1] // steps, round(1e3 * v[2] / steps, 3), round(1e3 * v[3] / steps, 3))
        for k, v in st.items()
    ]
    return dict(
        steps=steps,
        ms_per_step_profiled=round(1e3 * wall / steps, 2),
        top_own_ms=sorted(rows, key=lambda r: -r[2])[:40],
        top_cum_ms=sorted(rows, key=lambda r: -r[3])[:40],
        oscar_cum_ms=sorted((r for r in rows if "oscar" in r[0]), key=lambda r: -r[3])[:40],
    )


def shared_hits(
    llm,
    ctx: int,
    batch: int,
    gen: int,
    prompts,
    seed: int,
    vocab: int,
    sampling,
    greedy: dict,
    profile: bool = True,
) -> dict:  # noqa: ANN001, E501
    """``shared CTX BATCH GEN``: one ``CTX``-token prefix computed once, then ``BATCH`` requests of
    that prefix + 16 own tokens generating ``GEN`` (prefix-cache hits), another ``BATCH`` generating
    one (the hits' time), and, with ``profile``, two more batches of one-token hits: one under the
    torch profiler (device time a step by kernel), one under cProfile from ``add_request`` on (the
    host time a hit costs: request processing, block hashing, scheduling, the steps' Python).
    ``prompts(n, length, seed, vocab)`` makes token prompts."""
    prefix = prompts(1, ctx, seed, vocab)[0]
    tails = prompts(4 * batch + 1, 16, seed + 1, vocab)
    _timed(llm, [prefix + tails[-1]], sampling(max_tokens=1, **greedy))  # computes the prefix
    t_gen, out = _timed(llm, [prefix + x for x in tails[:batch]], sampling(max_tokens=gen, **greedy))
    t_one, _ = _timed(llm, [prefix + x for x in tails[batch : 2 * batch]], sampling(max_tokens=1, **greedy))
    res = {}
    if profile:
        # device time by kernel (H200, 12-04: 169 ms a hit for OSCAR vs 46 ms for FA3, unexplained
        # then; H100, 12-07: OSCAR's 48-hit step 1,424 ms of wall to 898 ms of device time)
        eng = llm.llm_engine
        one = sampling(max_tokens=1, **greedy)
        for i, x in enumerate(tails[2 * batch : 3 * batch]):
            eng.add_request(f"hp{seed}-{i}", {"prompt_token_ids": prefix + x}, one)
        res[f"hits_profile_{ctx}x{batch}"] = _gpu_kernels(eng, None)

        def hits() -> int:
            for i, x in enumerate(tails[3 * batch : 4 * batch]):
                eng.add_request(f"hy{seed}-{i}", {"prompt_token_ids": prefix + x}, one)
            n = 0
            while eng.has_unfinished_requests():
                eng.step()
                n += 1
            return n

        res[f"hits_pyprofile_{ctx}x{batch}"] = _cprofile(hits)
    res[f"shared_{ctx}x{batch}"] = dict(
        t_gen=round(t_gen, 3),
        t_hits=round(t_one, 3),
        decode_tok_s=round(batch * (gen - 1) / max(t_gen - t_one, 1e-9), 1),
        # steadier than the difference above (two ~10-s totals): the whole run's rate and what one
        # hit costs (H200, 12-03 night: 183 ms for OSCAR vs 33 ms for FA3)
        run_tok_s=round(batch * gen / max(t_gen, 1e-9), 1),
        ms_per_hit=round(1000 * t_one / batch, 1),
        all_tokens=all(len(o.outputs[0].token_ids) == gen for o in out),
    )
    return res


def _preemptions(llm) -> float | str:  # noqa: ANN001
    """vLLM's preemption counter (``vllm:num_preemptions``, from ``LLM.get_metrics``), or why not."""
    try:
        found = [m for m in llm.get_metrics() if "preempt" in m.name]
    except Exception as e:  # metrics are optional here (log stats off, another vLLM)
        return f"unavailable: {type(e).__name__}: {e}"
    return sum(getattr(m, "value", 0) for m in found) if found else "no preemption metric"


def _diagnostics(llm) -> dict:  # noqa: ANN001
    """OSCAR's own counters from the in-process worker (restores, records checked, mode)."""
    try:
        from vllm.config import get_current_vllm_config  # noqa: F401

        core = llm.llm_engine.engine_core.engine_core  # in-process engine core (no multiprocessing)
        runner = core.model_executor.driver_worker.worker.model_runner
        ctx = runner.vllm_config.compilation_config.static_forward_context
    except Exception as e:  # another executor layout: diagnostics are optional
        return {"unavailable": f"{type(e).__name__}: {e}"}
    impls = [
        layer.impl
        for layer in ctx.values()
        if type(getattr(layer, "impl", None)).__name__ == "OscarAttentionImpl"
    ]
    out: dict = {"oscar_layers": len(impls)}
    if impls:
        i = impls[0]
        out.update(cached=bool(i.cached), transient=bool(i.transient), max_seqs=int(i.max_seqs))
        out["window_bytes_per_layer"] = sum(w.numel() * w.element_size() for w in (i.windows or ()))
    groups = getattr(runner, "attn_groups", None)
    if groups:
        for gs in groups:
            for g in gs:
                b = g.get_metadata_builder() if hasattr(g, "get_metadata_builder") else None
                tr = getattr(b, "tracker", None)
                if tr is not None:
                    out["restores"] = int(tr.restores)
                st = getattr(b, "stamps", None)
                if st is not None:
                    out["records_checked"] = int(st.checked)
    return out


def maxdecode(
    llm, res: dict, ctx: int, gen: int, prompts, seed: int, vocab: int, sampling, greedy: dict
) -> dict:  # noqa: ANN001
    """The largest batch of distinct ``ctx``-token prompts the case's cache holds, decoding: tokens/s
    over ``gen`` steps with the whole batch decoding (:func:`full_batch_rate`). With the prefix cache
    a first pass (one token each) prefills the prompts and the timed pass finds them cached (each
    recomputes at most a block), so every request decodes from its first steps: generating through
    25 x 100k prefills, OSCAR's first requests finished before its last ones began (H100,
    2026-12-07: 458 steps, no full-batch one). ``prompts(n, length, seed, vocab)`` makes the
    prompts, ``sampling`` is vLLM's ``SamplingParams``."""
    # the engine's own count (OSCAR's pages also hold the window groups' blocks)
    tokens = res.get("kv_cache_size_tokens") or (res.get("num_gpu_blocks") or 0) * (
        res.get("block_size") or 0
    )
    step_tokens = int(llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens)
    block = res.get("block_size") or 16
    cached = bool(res.get("prefix_caching"))
    batch, n_gen = maxdecode_plan(
        tokens, ctx, gen, block, res["max_num_seqs"], step_tokens, block if cached else None
    )
    ps = prompts(batch, ctx, seed, vocab)
    fill = {}
    if cached:
        t_fill, _ = _timed(llm, ps, sampling(max_tokens=1, **greedy))
        fill = dict(t_prefill_all=round(t_fill, 3))
    timed = _stepped(llm, ps, sampling(max_tokens=n_gen, **greedy), f"m{seed}")
    return dict(timed, **fill, batch=batch, cache_tokens=tokens, generated=n_gen)


def run_case(spec: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.update(spec.get("env", {}))  # e.g. OSCAR_VLLM_V2_IDENTITY_RESTORES (this case's process only)
    from vllm import LLM, SamplingParams

    res: dict = {"name": spec["name"]}
    kw = dict(model=spec["model"], **spec.get("llm", {}))
    if spec.get("dummy", True):
        kw.update(load_format="dummy", skip_tokenizer_init=True)
    if spec["backend"] == "OSCAR":
        import oscar_vllm

        kw.update(oscar_vllm.llm_kwargs(spec["artifact"], **spec.get("oscar", {})))
    else:
        kw["attention_config"] = {"backend": spec["backend"]}
    t = time.perf_counter()
    with StackSampler() as sampler:  # where the start goes (sampling: the start's time stays honest)
        llm = LLM(**kw)
    res["start_s"] = round(time.perf_counter() - t, 1)
    res["start_samples"] = sampler.report(60)
    cfg = llm.llm_engine.vllm_config
    res["max_num_seqs"] = int(cfg.scheduler_config.max_num_seqs)
    res["prefix_caching"] = bool(cfg.cache_config.enable_prefix_caching)
    res["kv_cache_size_tokens"] = getattr(cfg.cache_config, "kv_cache_size_tokens", None)
    res["num_gpu_blocks"] = getattr(cfg.cache_config, "num_gpu_blocks", None)
    res["block_size"] = getattr(cfg.cache_config, "block_size", None)
    res["v2_runner"] = bool(getattr(cfg, "use_v2_model_runner", False))
    vocab = int(cfg.model_config.get_vocab_size())
    greedy = dict(temperature=0, ignore_eos=True, detokenize=False)
    seed = 1000
    for w in spec.get("work", []):
        kind = w[0]
        seed += 17
        try:
            if kind == "decode" and spec.get("stepped", True):
                _, ctx, batch, gen = w
                res[f"decode_{ctx}x{batch}"] = _stepped(
                    llm,
                    _prompts(batch, ctx, seed, vocab),
                    SamplingParams(max_tokens=gen, **greedy),
                    f"d{seed}",
                )
            elif kind == "maxdecode":  # ["maxdecode", CTX, GEN]: as many distinct CTX prompts as fit
                _, ctx, gen = w
                res[f"maxdecode_{ctx}"] = maxdecode(
                    llm, res, ctx, gen, _prompts, seed, vocab, SamplingParams, greedy
                )
            elif kind == "profile":  # ["profile", CTX, BATCH, STEPS]
                _, ctx, batch, steps = w
                sp = SamplingParams(max_tokens=steps + 8, **greedy)
                prompts = _prompts(batch, ctx, seed, vocab)
                res[f"profile_{ctx}x{batch}"] = _profile_decode(llm, prompts, sp, f"p{seed}", steps)
            elif kind == "pyprofile":  # ["pyprofile", CTX, BATCH, STEPS]: cProfile of decode steps
                _, ctx, batch, steps = w
                sp = SamplingParams(max_tokens=steps + 8, **greedy)
                prompts = _prompts(batch, ctx, seed, vocab)
                res[f"pyprofile_{ctx}x{batch}"] = _py_profile(llm, prompts, sp, f"y{seed}", steps)
            elif kind == "decode":
                _, ctx, batch, gen = w
                t_gen, out = _timed(
                    llm, _prompts(batch, ctx, seed, vocab), SamplingParams(max_tokens=gen, **greedy)
                )
                t_one, _ = _timed(
                    llm, _prompts(batch, ctx, seed + 1, vocab), SamplingParams(max_tokens=1, **greedy)
                )
                ok = all(len(o.outputs[0].token_ids) == gen for o in out)
                res[f"decode_{ctx}x{batch}"] = dict(
                    t_gen=round(t_gen, 3),
                    t_prefill=round(t_one, 3),
                    decode_tok_s=round(batch * (gen - 1) / max(t_gen - t_one, 1e-9), 1),
                    all_tokens=ok,
                )
            elif kind == "shared":
                _, ctx, batch, gen = w
                res.update(shared_hits(llm, ctx, batch, gen, _prompts, seed, vocab, SamplingParams, greedy))
            elif kind == "prefill_profile":  # one CTX-token prompt's steps under the profiler
                _, ctx = w
                eng = llm.llm_engine
                eng.add_request(f"pp{seed}", {"prompt_token_ids": _prompts(1, ctx, seed, vocab)[0]},
                                SamplingParams(max_tokens=1, **greedy))  # fmt: skip
                res[f"prefill_profile_{ctx}"] = _gpu_kernels(eng, None)
            elif kind == "prefill":  # one CTX-token prompt, one token generated: time to first token
                # twice, other prompts: the first pays Triton's compiles for this chunk size (once per
                # server), the second is what every later request of this length sees
                _, ctx = w
                sp1 = SamplingParams(max_tokens=1, **greedy)
                t_cold, _ = _timed(llm, _prompts(1, ctx, seed, vocab), sp1)
                t_one, _ = _timed(llm, _prompts(1, ctx, seed + 1, vocab), sp1)
                res[f"prefill_{ctx}"] = dict(t_prefill=round(t_one, 3), t_prefill_first=round(t_cold, 3))
            elif kind == "greedy":
                _, lens, gen = w
                prompts = [_prompts(1, n, 7 + n, vocab)[0] for n in lens]  # the same in every case
                _, out = _timed(llm, prompts, SamplingParams(max_tokens=gen, **greedy))
                res["greedy"] = [list(o.outputs[0].token_ids) for o in out]
            elif kind == "ppl":
                _, windows = w
                sp = SamplingParams(max_tokens=1, prompt_logprobs=0, **greedy)
                _, out = _timed(llm, windows, sp)
                nll = []
                for o, ids in zip(out, windows, strict=True):
                    lp = o.prompt_logprobs
                    nll.append([-lp[i][ids[i]].logprob for i in range(1, len(ids))])
                flat = [x for row in nll for x in row]
                res["ppl"] = math.exp(sum(flat) / len(flat))
                res["ppl_per_window"] = [math.exp(sum(r) / len(r)) for r in nll]
            elif kind == "repeat":
                _, length, gen = w
                p = _prompts(1, length, 4242, vocab)[0]
                sp = SamplingParams(max_tokens=gen, prompt_logprobs=0, logprobs=0, **greedy)
                _, a = _timed(llm, [p], sp)
                other = _prompts(1, length, 4343, vocab)[0]
                _timed(llm, [other], SamplingParams(max_tokens=gen, **greedy))  # takes the window slot
                _, b = _timed(llm, [p], sp)
                cont = p + list(a[0].outputs[0].token_ids)
                _, c = _timed(llm, [cont], SamplingParams(max_tokens=gen, **greedy))

                def plp(o) -> list[float]:  # noqa: ANN001
                    return [
                        d[t].logprob
                        for d, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)
                    ]

                res["repeat"] = dict(
                    cached_tokens=[getattr(x[0], "num_cached_tokens", None) for x in (a, b, c)],
                    tokens_equal=list(a[0].outputs[0].token_ids) == list(b[0].outputs[0].token_ids),
                    max_prompt_logprob_diff=max(
                        abs(x - y) for x, y in zip(plp(a[0]), plp(b[0]), strict=True)
                    ),
                    continuation=list(c[0].outputs[0].token_ids),
                )
            elif kind == "lp":  # prompt logprobs + greedy tokens of fixed prompts (TP = 1 vs 2)
                _, lens, gen = w
                prompts = [_prompts(1, n, 11 + n, vocab)[0] for n in lens]
                sp = SamplingParams(max_tokens=gen, prompt_logprobs=0, **greedy)
                _, out = _timed(llm, prompts, sp)
                res["lp"] = [
                    dict(
                        tokens=list(o.outputs[0].token_ids),
                        prompt_lp=[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)],
                    )
                    for o, p in zip(out, prompts, strict=True)
                ]
            elif kind == "many":  # more requests than the KV budget holds at once: vLLM preempts
                _, n, length, gen = w
                prompts = [_prompts(1, length, 900 + i, vocab)[0] for i in range(n)]
                _, out = _timed(llm, prompts, SamplingParams(max_tokens=gen, **greedy))
                res["many"] = [list(o.outputs[0].token_ids) for o in out]
                res["preemptions"] = _preemptions(llm)
            else:
                raise ValueError(f"unknown workload {kind}")
        except Exception as e:  # keep the engine's other workloads
            res.setdefault("errors", []).append(f"{kind}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        if spec["backend"] == "OSCAR":
            res["oscar"] = _diagnostics(llm)  # restores so far
        # what is done so far survives a case that runs out of time
        print(PARTIAL + json.dumps(res), flush=True)
    res["oscar"] = _diagnostics(llm) if spec["backend"] == "OSCAR" else None
    return res


# ---- the suite --------------------------------------------------------------------------------


def _cases(a: argparse.Namespace) -> list[dict]:
    q, s, tp = a.qwen, a.smol, a.tp
    cases: list[dict] = []
    smol_art = str(Path(a.out) / "smollm2.oscar.safetensors")
    qwen_art = str(Path(a.out) / "qwen3-8b-shape.identity.safetensors")
    # SmolLM2, real weights: the same prompts through every configuration
    g = ["greedy", [40, 300, 700, 1500], 24]
    small = {"max_model_len": 4096, "gpu_memory_utilization": 0.25}
    if s:
        base = dict(model=s, dummy=False, artifact=smol_art)
        ppl = ["ppl", a.ppl_windows]
        for name, backend, eager, cache in (
            ("smol-bf16-eager", "TRITON_ATTN", True, True),
            ("smol-oscar-eager-nocache", "OSCAR", True, False),
            ("smol-oscar-eager-cache", "OSCAR", True, True),
            ("smol-oscar-graph-cache", "OSCAR", False, True),
            ("smol-oscar-graph-nocache", "OSCAR", False, False),
        ):
            work = [g, ["repeat", 890, 16]] + ([ppl] if a.ppl_windows else [])
            llm = dict(small, enforce_eager=eager, enable_prefix_caching=cache)
            cases.append(dict(base, name=name, backend=backend, llm=llm, work=work))
        # preemption: 24 requests of 200 prompt + 1,200 generated tokens (33.6k in all), all admitted at
        # once (max_num_seqs 24: their prompts, 4.8k tokens, fit), max_model_len 2048. 24 slots' windows
        # (~169 MiB) + ~95 MiB of pages (~26k tokens) cannot hold the requests' growth, so vLLM must
        # preempt running requests and resume them (the counter says how often). The earlier shape
        # (1,500 + 64 tokens) read 0 preemptions on the H200 (2026-12-04): vLLM admitted only what
        # fitted and queued the rest.
        # the fallback to restores by block ids (OSCAR_VLLM_V2_IDENTITY_RESTORES=0; identity restores are the
        # default since they gave this case's greedy tokens, perplexity and hit on the H200): the
        # same work as smol-oscar-eager-cache, and the same results
        blockids = {"OSCAR_VLLM_V2_IDENTITY_RESTORES": "0"}
        llm = dict(small, enforce_eager=True, enable_prefix_caching=True)
        work = [g, ["repeat", 890, 16]] + ([ppl] if a.ppl_windows else [])
        name = "smol-oscar-eager-cache-blockids"
        cases.append(dict(base, name=name, backend="OSCAR", llm=llm, work=work, env=blockids))
        # the start-up warm-up (OSCAR_VLLM_WARMUP=1; by default it runs only where vLLM warms its own
        # kernels, not eager): the same work, results equal the plain case's
        warm = {"OSCAR_VLLM_WARMUP": "1"}
        cases.append(
            dict(base, name="smol-oscar-eager-cache-warm", backend="OSCAR", llm=llm, work=work, env=warm)
        )
        # short chunks over long prefixes unsplit (OSCAR_VLLM_SPLIT_EXTEND=0; split is the default):
        # results must equal the plain case's
        split = {"OSCAR_VLLM_SPLIT_EXTEND": "0"}
        cases.append(
            dict(base, name="smol-oscar-eager-cache-nosplit", backend="OSCAR", llm=llm, work=work, env=split)
        )
        fits = dict(  # log stats on: vLLM's preemption counter (LLM.get_metrics) says what happened
            small, max_model_len=2048, max_num_batched_tokens=1024, enforce_eager=True, max_num_seqs=24,
            disable_log_stats=False,
        )  # fmt: skip
        tight = dict(fits, kv_cache_memory_bytes=264 << 20)
        cases.append(
            dict(base, name="smol-oscar-preempt", backend="OSCAR", llm=tight, work=[["many", 24, 200, 1200]])
        )
        cases.append(
            dict(
                base,
                name="smol-oscar-many-roomy",
                backend="OSCAR",
                llm=dict(fits),
                work=[["many", 24, 200, 1200]],
            )
        )
        cases.append(
            dict(
                base,
                name="smol-bad-artifact",
                backend="OSCAR",
                artifact="/nonexistent/rot.safetensors",
                llm=dict(small, enforce_eager=True),
                work=[],
                expect_fail=True,
            )
        )
    if q:
        big = {"tensor_parallel_size": tp} if tp > 1 else {}
        if a.capture_sizes:
            big["compilation_config"] = {"cudagraph_capture_sizes": a.capture_sizes}
        # a short decode first (step time at batch 1: FULL graph or not), then the targets' shapes
        w = [
            ["decode", 2048, 1, 128],
            ["profile", 4096, 4, 16],  # FULL graph or not, host launches per step
            ["prefill", 32768],
            ["prefill_profile", 32768],  # device time by kernel over the prompt's steps
            ["decode", 32768, 8, 128],
            ["decode", 130000, 1, 128],
            # many shorter sequences, as a reasoning server's steps (both caches hold 32 x 8k): where
            # a large-batch step goes (the serving benchmark's OSCAR step reached 45 % of its byte limit)
            ["decode", 8192, 32, 128],
            ["maxdecode", 100000, 64],  # the largest batch of distinct 100k prompts each cache holds
        ]
        # eager: the per-layer host cost (OSCAR's decode step minus FA3's, over 36 layers)
        w_eager = [["decode", 2048, 1, 64], ["decode", 2048, 16, 64], ["profile", 2048, 1, 8]]
        w_eager.append(["pyprofile", 2048, 4, 8])  # which Python functions the eager host time is
        w_eager.append(["prefill", 32768])  # prefill runs attention eagerly in every configuration
        for name, backend, cache, extra in (
            ("qwen-oscar-cache", "OSCAR", True, {}),  # first: the configuration users get
            ("qwen-oscar-cache-blockids", "OSCAR", True, {"env": {"OSCAR_VLLM_V2_IDENTITY_RESTORES": "0"}}),
            # the first 2k prompt's time to first token with the start-up warm-up (14.0 s without, 12-03)
            ("qwen-oscar-cache-warm", "OSCAR", True, {"env": {"OSCAR_VLLM_WARMUP": "1"}}),
            # short chunks over long prefixes unsplit (the default splits them: the shared-100k hits)
            ("qwen-oscar-cache-nosplit", "OSCAR", True, {"env": {"OSCAR_VLLM_SPLIT_EXTEND": "0"}}),
            # each decode layer joins its own INT2 pass and records (the default leaves them to the next)
            ("qwen-oscar-cache-onelayer", "OSCAR", True, {"env": {"OSCAR_OVERLAP_LAYERS": "0"}}),
            ("qwen-bf16-fa3", "FLASH_ATTN", True, {}),
            ("qwen-oscar-nocache", "OSCAR", False, {}),
            ("qwen-bf16-triton", "TRITON_ATTN", True, {}),
            ("qwen-oscar-eager", "OSCAR", True, {"enforce_eager": True}),
            ("qwen-bf16-eager", "FLASH_ATTN", True, {"enforce_eager": True}),
            ("qwen-oscar-eager-nocache", "OSCAR", False, {"enforce_eager": True}),
        ):
            if a.skip_triton and backend == "TRITON_ATTN":
                continue
            env = extra.pop("env", {})
            llm = dict(big, enable_prefix_caching=cache, **extra)
            if extra.get("enforce_eager"):
                llm.pop("compilation_config", None)
                cases.append(
                    dict(name=name, model=q, backend=backend, artifact=qwen_art, llm=llm, work=list(w_eager))
                )
                continue
            case = dict(name=name, model=q, backend=backend, artifact=qwen_art, llm=llm, work=list(w))
            cases.append(dict(case, shared=True, env=env))
    if q and a.tp_cases:
        # tensor parallelism (issue 26): TP = 1 vs TP = 2 on the same dummy weights and prompts, at
        # 8 KV heads (each rank holds 4) and at 1 KV head (replicated on both ranks)
        for kv in (8, 1):
            model = str(Path(a.out) / f"qwen3-8b-shape-kv{kv}")
            for tp_size in (1, 2):
                llm = {"tensor_parallel_size": tp_size, "max_model_len": 40000, "enable_prefix_caching": True}
                work = [["lp", [300, 1200], 16], ["decode", 32768, 8, 64]]
                cases.append(
                    dict(
                        name=f"tp{tp_size}-kv{kv}",
                        model=model,
                        backend="OSCAR",
                        artifact=str(Path(a.out) / f"qwen3-8b-shape-kv{kv}.safetensors"),
                        llm=llm,
                        work=work,
                        kv_heads=kv,
                    )
                )
    only = set(filter(None, (a.only or "").split(",")))
    return [c for c in cases if not only or c["name"] in only]


#: the compile caches a case's process writes (Triton's kernels, Inductor's, vLLM's torch.compile)
CACHE_ENV = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT")


def case_cache_env(root: Path, name: str) -> dict[str, str]:
    """The environment that gives case ``name`` compile caches of its own under ``root`` (empty at
    its first start, whatever ran before it; the same folders at a second start)."""
    return {k: str(root / name / k.lower()) for k in CACHE_ENV}


def _run_one(spec: dict, timeout: float, log, env: dict | None = None) -> dict:  # noqa: ANN001
    cmd = [sys.executable, __file__, "case", json.dumps(spec)]
    t = time.perf_counter()
    try:
        full = None if env is None else {**os.environ, **env}
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full)
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += (
            (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        )
        rc = "timeout"
    wall = round(time.perf_counter() - t, 1)
    res: dict = {"name": spec["name"], "rc": rc, "wall_s": wall}
    for line in text.splitlines():  # the last partial result, then the final one if it came
        for tag in (PARTIAL, RESULT):
            if line.startswith(tag):
                res.update(json.loads(line[len(tag) :]))
    cap = CAPACITY.findall(text)
    if cap:
        res["log_kv_tokens"] = int(cap[-1].replace(",", ""))
    conc = CONCURRENCY.findall(text)
    if conc:
        res["log_concurrency"] = [int(conc[-1][0].replace(",", "")), float(conc[-1][1])]
    res["jit_compiles"] = [ln[-160:] for ln in text.splitlines() if "JIT compilation during inference" in ln][
        :20
    ]
    res["graph_lines"] = [ln[-240:] for ln in text.splitlines() if GRAPH_LINE.search(ln)][:8]
    res["start_lines"] = [ln[-240:] for ln in text.splitlines() if START_LINE.search(ln)][:24]
    m = OSCAR_SEQS.findall(text)
    if m:
        res["oscar_default_max_num_seqs"] = int(m[-1])
    tail_lines = text.splitlines()
    res["oscar_lines"] = [ln[-300:] for ln in tail_lines if "OSCAR" in ln and "Traceback" not in ln][:12]
    if rc not in (0,):
        errs = [ln for ln in tail_lines if "Error" in ln or "error" in ln][-6:]
        res["error_lines"] = [e[-400:] for e in errs]
        res["last_line"] = tail_lines[-1][-400:] if tail_lines else ""
        res["log_lines"] = len(tail_lines)
        res["tracebacks"] = text.count("Traceback (most recent call last)")
    log.write(f"\n===== {spec['name']} rc={rc} wall={wall}s =====\n")
    log.write("\n".join(tail_lines[-(60 if rc else 25) :]) + "\n")
    log.flush()
    return res


def _artifacts(a: argparse.Namespace) -> None:
    """The SmolLM2 artifact (``oscar calibrate`` on the GPU) and a Qwen3-shape identity artifact."""
    out = Path(a.out)
    if a.qwen:
        from oscar_math.artifact import save_rotations

        save_rotations(
            out / "qwen3-8b-shape.identity.safetensors", _qwen_artifact(Path(a.qwen) / "config.json")
        )
    if a.qwen and a.tp_cases:
        for kv in (8, 1):
            folder = out / f"qwen3-8b-shape-kv{kv}"
            folder.mkdir(exist_ok=True)
            cfg = json.loads((Path(a.qwen) / "config.json").read_text())
            cfg["num_key_value_heads"] = kv
            (folder / "config.json").write_text(json.dumps(cfg))
            save_rotations(out / f"qwen3-8b-shape-kv{kv}.safetensors", _qwen_artifact(folder / "config.json"))
    if a.smol and not (out / "smollm2.oscar.safetensors").exists():
        t = time.perf_counter()
        subprocess.run(
            [
                "oscar",
                "calibrate",
                a.smol,
                "--device",
                "cuda",
                "--tokens",
                "16384",
                "--out",
                str(out / "smollm2.oscar.safetensors"),
            ],
            check=True,
        )
        print(f"calibrated SmolLM2 on the GPU in {time.perf_counter() - t:.1f}s", flush=True)


def _qwen_artifact(config: Path):  # noqa: ANN202 - Rotations
    """A format-3 artifact of the dummy model's shape with what the default serves: per-KV-head
    rotations (identity: dummy weights have no statistics), a key mean and a pre-RoPE key mean on
    8 frequency pairs (the default's decode cost), key error-feedback matrices (``oscar calibrate``'s
    default ``--feedback k``: the write's cost; strictly lower triangular, small random entries),
    clip 0.9."""
    import dataclasses

    import torch

    from oscar_math.artifact import identity_rotations

    cfg = json.loads(config.read_text())
    n, h, d = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
    rot = identity_rotations("qwen3-8b-shape", n, h, d, granularity="kv_head", k_clip=0.9, v_clip=0.9)
    g = torch.Generator().manual_seed(0)
    rope = []
    for _ in range(n):
        m = torch.zeros(h, d)
        pairs = torch.arange(8)
        m[:, pairs] = torch.randn(h, 8, generator=g)
        m[:, pairs + d // 2] = torch.randn(h, 8, generator=g)
        rope.append(m)
    inv_freq = 1.0 / (
        float(cfg.get("rope_theta", 10000.0)) ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    )
    return dataclasses.replace(
        rot,
        k_feedback=[0.05 * torch.randn(h, d, d, generator=g).tril(-1) for _ in range(n)],
        k_mean=[0.1 * torch.randn(h, d, generator=g) for _ in range(n)],
        k_rope_mean=rope,
        rope_inv_freq=inv_freq,
    )


def _ppl_windows(model: str, n: int, length: int) -> list[list[int]]:
    """Held-out text windows (the harness's evaluation text) as token ids."""
    from transformers import AutoTokenizer

    from oscar_calib.text import builtin_text, split_text

    tok = AutoTokenizer.from_pretrained(model)
    ids = tok(split_text(builtin_text())[1], return_tensors=None)["input_ids"]
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def _compare(results: dict) -> dict:
    """Cross-case checks: greedy agreement with BF16, preemption outputs, capacity ratios."""
    out: dict = {}
    ref = results.get("smol-bf16-eager", {}).get("greedy")
    for name, r in results.items():
        gr = r.get("greedy")
        if ref and gr and name != "smol-bf16-eager":
            agree = []
            for x, y in zip(ref, gr, strict=False):
                k = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), len(x))
                agree.append(k)
            out[f"greedy_first_divergence[{name}]"] = agree
    oscar_graph = results.get("smol-oscar-graph-cache", {}).get("greedy")
    oscar_eager = results.get("smol-oscar-eager-cache", {}).get("greedy")
    if oscar_graph and oscar_eager:
        out["oscar_graph_vs_eager_equal"] = oscar_graph == oscar_eager
    a, b = (
        results.get("smol-oscar-preempt", {}).get("many"),
        results.get("smol-oscar-many-roomy", {}).get("many"),
    )
    if a and b:
        out["preempt_requests_equal"] = sum(x == y for x, y in zip(a, b, strict=True))
        out["preempt_requests"] = len(a)
    for kv in (8, 1):
        one, two = results.get(f"tp1-kv{kv}", {}).get("lp"), results.get(f"tp2-kv{kv}", {}).get("lp")
        if one and two:
            out[f"tp2_vs_tp1_kv{kv}"] = dict(
                tokens_equal=[x["tokens"] == y["tokens"] for x, y in zip(one, two, strict=True)],
                max_prompt_logprob_diff=max(
                    abs(u - v)
                    for x, y in zip(one, two, strict=True)
                    for u, v in zip(x["prompt_lp"], y["prompt_lp"], strict=True)
                ),
            )
            r1, r2 = results[f"tp1-kv{kv}"], results[f"tp2-kv{kv}"]
            if r1.get("log_kv_tokens") and r2.get("log_kv_tokens"):
                out[f"tp2_vs_tp1_kv{kv}_kv_tokens"] = [r1["log_kv_tokens"], r2["log_kv_tokens"]]
            d1, d2 = r1.get("decode_32768x8", {}), r2.get("decode_32768x8", {})
            if d1.get("decode_tok_s") and d2.get("decode_tok_s"):
                out[f"tp2_vs_tp1_kv{kv}_decode"] = round(d2["decode_tok_s"] / d1["decode_tok_s"], 2)
    for base_name, names in (
        (
            "qwen-bf16-fa3",
            ("qwen-oscar-cache", "qwen-oscar-cache-onelayer", "qwen-oscar-nocache", "qwen-bf16-triton"),
        ),
        ("qwen-bf16-eager", ("qwen-oscar-eager", "qwen-oscar-eager-nocache")),
    ):
        bf = results.get(base_name, {})
        bf_shared = next((v for k, v in bf.items() if k.startswith("shared_")), None)
        for name in names:
            r = results.get(name, {})
            if bf.get("log_kv_tokens") and r.get("log_kv_tokens"):
                out[f"capacity_ratio[{name}]"] = round(r["log_kv_tokens"] / bf["log_kv_tokens"], 2)
            for key in ("start_s", "start_warm_s"):  # LLM(...) time against the baseline's
                if bf.get(key) and r.get(key):
                    out[f"{key.replace('_s', '')}_ratio[{name}]"] = round(r[key] / bf[key], 2)
            for k, v in r.items():
                if not isinstance(v, dict):
                    continue
                # the largest batch each holds at 100k differs: compare the shared rows whatever the batch
                base = bf_shared if k.startswith("shared_") else bf.get(k)
                if not base:
                    continue
                if v.get("decode_tok_s") and base.get("decode_tok_s"):
                    out[f"{k}_ratio[{name}]"] = round(v["decode_tok_s"] / base["decode_tok_s"], 2)
                if k.startswith(("decode_", "prefill_")) and v.get("t_prefill") and base.get("t_prefill"):
                    out[f"{k}_prefill_ratio[{name}]"] = round(v["t_prefill"] / base["t_prefill"], 2)
    # eager decode at batch 1 and 2k context is host-bound: the step-time difference per layer is
    # OSCAR's extra host cost per attention layer
    e_o, e_b = results.get("qwen-oscar-eager", {}), results.get("qwen-bf16-eager", {})
    for k in ("decode_2048x1", "decode_2048x16"):
        o, b = e_o.get(k, {}).get("decode_tok_s"), e_b.get(k, {}).get("decode_tok_s")
        if o and b:
            batch = int(k.rsplit("x", 1)[1])
            step_o, step_b = batch / o, batch / b
            out[f"eager_step_ms[{k}]"] = [round(step_o * 1e3, 2), round(step_b * 1e3, 2)]
            out[f"eager_extra_us_per_layer[{k}]"] = round((step_o - step_b) / QWEN_LAYERS * 1e6, 1)
    return out


def suite(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _artifacts(a)
    if a.smol and a.ppl_n:
        a.ppl_windows = _ppl_windows(a.smol, a.ppl_n, a.ppl_len)
    else:
        a.ppl_windows = None
    cases = _cases(a)
    results: dict = {}
    t0 = time.perf_counter()
    with open(out / "gpu_engine.log", "w") as log:
        for spec in cases:
            left = a.budget_s - (time.perf_counter() - t0)
            if left < 30:
                results[spec["name"]] = {"name": spec["name"], "rc": "skipped: budget"}
                continue
            # prefix-cache hits stand in for prefills only where caching is on
            if (
                spec.get("shared")
                and spec["llm"].get("enable_prefix_caching", True)
                and "triton" not in spec["name"]
            ):
                spec = dict(spec, work=spec["work"] + [["shared", 100000, _shared_batch(spec, results), 64]])
            if a.work:  # a shorter run: only these workload kinds (e.g. "decode,shared")
                spec = dict(spec, work=[w for w in spec["work"] if w[0] in a.work])
            env = None
            if a.caches != "shared":  # its own empty caches: the start is cold whatever ran first
                env = case_cache_env(Path(a.cache_root), spec["name"])
            r = _run_one(spec, min(a.case_timeout, left), log, env)
            results[spec["name"]] = r
            # on disk before the second start: a device call cut by its limit keeps this case's rows
            (out / "gpu_engine.json").write_text(json.dumps({"results": results}, indent=1))
            left = a.budget_s - (time.perf_counter() - t0)
            if a.caches == "cold+warm" and left >= 30:  # a second start on the caches of the first
                w = _run_one(dict(spec, work=[]), min(a.case_timeout, left), log, env)
                r["start_warm_s"] = w.get("start_s")
                r["start_warm_samples"] = w.get("start_samples")
            if spec.get("expect_fail"):
                r["ok"] = r["rc"] not in (0, "timeout")
            results[spec["name"]] = r
            errs = r.get("errors") or r.get("error_lines")
            print(
                f"{spec['name']}: rc={r['rc']} wall={r['wall_s']}s kv={r.get('log_kv_tokens')} errors={errs}",
                flush=True,
            )
            (out / "gpu_engine.json").write_text(json.dumps({"results": results}, indent=1))
    summary = _compare(results)
    (out / "gpu_engine.json").write_text(json.dumps({"results": results, "summary": summary}, indent=1))
    _table(results, summary)
    return 0


def max_batch(cache_tokens: int, ctx: int, gen: int, block: int, max_seqs: int) -> int:
    """The most distinct ``ctx``-token prompts generating ``gen`` tokens each whose blocks fit
    ``cache_tokens`` at once (each request holds ``ceil((ctx + gen) / block)`` blocks; no sharing),
    at most ``max_seqs`` and at least 1."""
    per = -(-(ctx + gen) // block) * block
    return max(1, min(max_seqs, cache_tokens // per))


def _shared_batch(spec: dict, results: dict) -> int:
    """The largest batch of 100k-token requests each backend's capacity holds (vLLM's log lines on
    the H200, 2026-12-02: BF16 FA3 807,392 tokens -> 8; OSCAR 5,473,890 -> 54, run at 48)."""
    return 48 if spec["backend"] == "OSCAR" else 807_392 // 100_064


def _table(results: dict, summary: dict) -> None:
    print(f"\n{'case':28} {'rc':>7} {'start':>6} {'KV tokens':>10} {'seqs':>5}  workloads")
    for name, r in results.items():
        w = []
        for k, v in r.items():
            if isinstance(v, dict) and k.startswith("prefill_") and "t_prefill" in v:
                w.append(f"{k}={v['t_prefill']}s")
            if isinstance(v, dict) and "ms_per_hit" in v:
                w.append(f"{k}: run {v['run_tok_s']} tok/s, {v['ms_per_hit']} ms/hit")
            elif isinstance(v, dict) and "decode_tok_s" in v:
                w.append(
                    f"{k}={v['decode_tok_s']} tok/s"
                    + (f" (prefill {v['t_prefill']}s)" if "t_prefill" in v else "")
                )
        if "ppl" in r:
            w.append(f"ppl={r['ppl']:.4f}")
        if r.get("start_warm_s") is not None:
            w.append(f"second start {r['start_warm_s']}s")
        if "repeat" in r:
            rp, dl = r["repeat"], "max_prompt_logprob_diff"
            w.append(f"repeat: cached={rp['cached_tokens']} equal={rp['tokens_equal']} dlp={rp[dl]:.3g}")
        cols = [str(r.get(k, "")) for k in ("rc", "start_s", "log_kv_tokens", "max_num_seqs")]
        print(f"{name:28} {cols[0]:>7} {cols[1]:>6} {cols[2]:>10} {cols[3]:>5}  {'; '.join(w)}")
        for e in (r.get("errors") or []) + (r.get("error_lines") or [])[-2:]:
            print(f"{'':28}   ! {e[:200]}")
    print()
    for k, v in summary.items():
        print(f"{k}: {v}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("suite")
    s.add_argument("--out", required=True)
    s.add_argument("--only", default="")
    s.add_argument("--qwen", default="")
    s.add_argument("--smol", default="")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--budget-s", type=float, default=540)
    s.add_argument("--case-timeout", type=float, default=300)
    s.add_argument("--capture-sizes", type=lambda x: [int(v) for v in x.split(",")], default=None)
    s.add_argument("--skip-triton", action="store_true")
    s.add_argument(
        "--caches",
        choices=("shared", "cold", "cold+warm"),
        default="shared",
        help="shared: every case uses the process's compile caches (a later case may find kernels "
        "an earlier one compiled); cold: each case its own empty ones (TRITON_CACHE_DIR, "
        "TORCHINDUCTOR_CACHE_DIR, VLLM_CACHE_ROOT under --cache-root); cold+warm: also a second start "
        "of each case on its caches (start_warm_s)",
    )
    s.add_argument("--cache-root", default="/tmp/oscar-bench-caches")
    s.add_argument(
        "--work",
        type=lambda x: set(x.split(",")),
        default=None,
        help="keep only these workload kinds (decode, profile, prefill, prefill_profile, shared, ...)",
    )
    s.add_argument("--tp-cases", action="store_true", help="TP = 1 vs 2 at 8 and 1 KV heads (two GPUs)")
    s.add_argument("--ppl-n", type=int, default=4)
    s.add_argument("--ppl-len", type=int, default=2048)
    c = sub.add_parser("case")
    c.add_argument("spec")
    q = sub.add_parser("qwen-artifact", help="write the Qwen3-8B-shape format-3 artifact (no vLLM needed)")
    q.add_argument("config", help="the model's config.json")
    q.add_argument("out")
    a = p.parse_args()
    if a.cmd == "qwen-artifact":
        from oscar_math.artifact import save_rotations

        if not Path(a.out).is_file():
            save_rotations(a.out, _qwen_artifact(Path(a.config)))
        return 0
    if a.cmd == "case":
        res = run_case(json.loads(a.spec))
        print(RESULT + json.dumps(res), flush=True)
        return 0
    return suite(a)


if __name__ == "__main__":
    sys.exit(main())
