"""Compile OSCAR's Triton kernels while the engine starts, not at the first requests that need them.

Triton compiles a kernel at its first launch with each specialisation: the constexprs (the
write's token tile, the scratch ring of a long chunk's window rows, a decode batch's split count
and tile) and the value class of each int. vLLM's own warm-up runs 2-token prompts, and none with
``enforce_eager``; on the H200 the first 2k-token prompt after a start took 14.0 s to its first
token (FA3: 0.05 s), and vLLM's monitor named ``paged_write_kernel``, ``rotate_tiles_kernel`` and
``window_records_kernel`` as compiled during inference.

:func:`warmup_steps` lists steps (rows of ``(cached tokens, new tokens)``) that between them launch
every specialisation a server can meet; :func:`run_warmup` runs one layer's step functions
(:func:`oscar_kernels.serving.run_layer`, :func:`oscar_kernels.serving.write_window_pages`) over them on a
scratch cache with the layer's own layout, parameters and block-table widths, so the engine's
pages and window slots are never touched. The backend runs it once per distinct layer
configuration after vLLM's warm-up (``compat.after_model_warm_up``): by default where vLLM warms its
own kernels (CUDA graphs), ``OSCAR_VLLM_WARMUP=1`` / ``0`` to choose.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import torch

from oscar_kernels import CacheLayout, PagedKVCache, cache_from_page_buffer, page_bytes
from oscar_kernels.extend_attention import DENSE_MIN_QUERY
from oscar_kernels.serving import (
    StepPlan,
    WindowPages,
    WindowPlan,
    plan_step,
    run_layer,
    scratch_ring,
    write_window_pages,
)

from . import compat
from .settings import settings_from
from .warmup_plans import WarmupPlans, cache_entries, triton_cache_dir

log = logging.getLogger("oscar_vllm")

__all__ = [
    "warmup_steps",
    "run_warmup",
    "warm_up_engine",
    "compile_ahead_engine",
    "warmup_wanted",
    "compile_workers",
    "WarmupPlans",
    "WARMUP_ENV",
]

#: ``1`` / ``0``: run the warm-up at engine start or not (unset: where vLLM warms its own kernels;
#: without it each specialisation compiles at its first request)
WARMUP_ENV = "OSCAR_VLLM_WARMUP"

Step = tuple[tuple[int, int], ...]

#: chunk lengths of the split tails: each of the extend kernel's row counts for GQA 1 to 16 (2, 3,
#: 5, 9, 16 tokens) and chunks of several token blocks (17, 33, 65), whose grid sizes and longest
#: contexts pick the split count
TAIL_LENS = (2, 3, 5, 9, 16, 17, 33, 65)

#: window slots of the scratch windows (rows of a step share them: the values are never read)
_SCRATCH_SLOTS = 4


def warmup_steps(
    page_size: int,
    recent: int,
    max_tokens: int,
    max_seqs: int,
    max_len: int,
    dense_min_query: int | None = DENSE_MIN_QUERY,
    split_tails: bool = False,
) -> list[Step]:
    """Steps whose launches cover every Triton specialisation of a layer's step.

    Args:
        page_size: tokens per page; recent: the layout's ring length.
        max_tokens: the most tokens one step holds (vLLM's ``max_num_batched_tokens``).
        max_seqs: the most rows one step holds (``max_num_seqs``).
        max_len: the most tokens one row's block table holds.
        dense_min_query: the shortest chunk the dense prefill takes (None: no dense prefill).
        split_tails: the layer splits short chunks over long prefixes (``extend_splits="auto"``):
            also short chunks (:data:`TAIL_LENS`) of 1-16 rows over prefixes of every power of two,
            whose grid size and context pick the split count (the split path compiles per row count).
    Returns:
        Steps, each a tuple of rows ``(cached tokens, new tokens)``.
    """
    cap = min(max_tokens, max_len - 2 * page_size - 3)
    # the write's token tiles: 16, 32, 64, 128 tokens (and its cap); 2, 3, 5, 9: the extend kernel's
    # rows (chunk tokens x GQA heads, 16 / 32 / 64 by oscar_kernels.extend_block_m) for GQA 1 to 16
    lens = {2, 3, 5, 9, 17, 33, 65, 129}
    r = scratch_ring(recent + 1)  # chunks longer than the ring: a scratch ring per power of two
    while r <= scratch_ring(cap):
        lens.add(max(recent + 1, r // 2 + 1))
        r *= 2
    steps: list[Step] = [((0, n),) for n in sorted(lens) if n <= cap]
    steps.append(((page_size + 3, 17),))  # an extend over cached pages
    if dense_min_query is not None and dense_min_query <= cap:
        # dense prefill with far rows: the prefix reaches past the ring, or the far-rows kernel
        # (oscar_kernels' kernels/far_rows.py) would compile at the first long prompt
        pre = min(max(2 * page_size + 3, recent + page_size + 3), max_len - dense_min_query)
        steps.append(((pre, dense_min_query),))
    if max_seqs >= 2:
        steps.append(((5, 1), (0, 17)))  # a mixed batch: decodes in the extend kernel
    # pure decode steps of every batch size: a batch's size picks the split count and tile
    steps.extend(((3, 1),) * b for b in range(1, max_seqs + 1))
    if split_tails:
        for n in TAIL_LENS:  # every row count of a program, one to five token blocks
            for b in range(1, min(max_seqs, 16) + 1):
                if b * n > max_tokens:
                    break
                p = 256
                while p < max_len:
                    steps.append(((min(p, max_len) - n, n),) * b)
                    p *= 2
                steps.append(((max_len - n, n),) * b)
    return steps


def _scratch(
    lo: CacheLayout, plan: WindowPlan | None, num_pages: int, device: torch.device
) -> tuple[PagedKVCache, WindowPages | None]:
    """A cache of ``num_pages`` pages laid out as the engine's (views of one page buffer, so the
    kernels see the same strides) with scratch BF16 windows, and its window pages."""
    buf = torch.zeros(num_pages, page_bytes(lo), dtype=torch.uint8, device=device)
    c = cache_from_page_buffer(lo, buf, _SCRATCH_SLOTS)
    pages = None
    if plan is not None:
        d = lo.head_dim
        rows = buf.view(torch.bfloat16).view(num_pages, buf.shape[1] // (2 * d), d)
        pages = WindowPages(rows, lo.num_kv_heads, plan, lo.sink_tokens)
    return c, pages


def _step_metadata(rows: Step, width: int, page: int, dev: torch.device, slots: int) -> StepPlan:
    """A step's metadata: each row's cached whole pages all on scratch page 1, its other pages
    consecutive from page 2 (page 0 stays unused, as vLLM's null block), so a long prefix costs one
    page; built with whole-tensor ops (a decode step may have hundreds of rows)."""
    p = torch.tensor([r[0] for r in rows], dtype=torch.int64)
    n = torch.tensor([r[1] for r in rows], dtype=torch.int64)
    b, seq = len(rows), p + n
    full = p // page  # whole pages before the new tokens: all on page 1 (read, never written)
    used = -(-seq // page) - full
    first = 2 + torch.cumsum(used, 0) - used
    col = torch.arange(width)[None]
    own = torch.where(col < full[:, None] + used[:, None], first[:, None] + col - full[:, None], 0)
    table = torch.where(col < full[:, None], 1, own).to(torch.int32)
    qsl = torch.zeros(b + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(n, 0)
    row = torch.repeat_interleave(torch.arange(b), n)
    pos = p[row] + torch.arange(int(qsl[-1])) - qsl[row]
    mapping = table[row, pos // page].long() * page + pos % page
    qsl, seq = qsl.to(torch.int32), seq.to(torch.int32)
    ws = torch.arange(b, dtype=torch.int32) % slots
    return plan_step(qsl.to(dev), qsl, seq.to(dev), seq, table.to(dev), mapping.to(dev), b, ws, None)


def run_warmup(
    cache: PagedKVCache,
    params: object,
    num_heads: int,
    scale: float,
    steps: Sequence[Step],
    table_width: int,
    plan: WindowPlan | None = None,
    window_table_width: int = 0,
    dense: object | None = None,
    backend: str = "auto",
    done: set[tuple] | None = None,
    extend_splits: int | str = 1,
    overlap_write: bool = True,
    overlap_rotation: bool = False,
    only: Sequence[int] | None = None,
    seconds: dict[str, float] | None = None,
    compile_workers: int = 1,
    compile_only: bool = False,
) -> list[int]:
    """Run one layer's step functions over ``steps`` on a scratch copy of ``cache``'s layout.

    Every step first runs dry (``oscar_kernels.launch.record_launches(dry=True)``: host work only,
    its launches' compile keys recorded); the kernels of keys not in ``done`` are then compiled
    ``compile_workers`` at a time (``oscar_kernels.launch.compile_launches``), and only the steps
    that launched a new key run for real: of a thousand decode batch sizes a handful compile
    differently. With ``only`` (the indices an earlier, identical warm-up ran for real:
    :class:`WarmupPlans`) those steps run for real and nothing runs dry (a few seconds of host work
    a start: ~1,400 dry steps with split tails at the Qwen3-8B shape).

    Args:
        cache: the layer's cache (its layout and device; its pages are not written).
        params: the layer's expanded parameters.
        num_heads: query heads; scale: the softmax scale.
        steps: :func:`warmup_steps`.
        table_width: columns of the engine's INT2 block table (decode launches depend on it).
        plan, window_table_width: the layer's window records and their tables' width (prefix
            caching; None: no window pages).
        dense: the layer's dense prefill (``oscar_kernels.DenseAttention``), if any.
        backend: as :func:`oscar_kernels.serving.run_layer` (``triton``: the interpreter on a CPU).
        done: compile keys already launched (shared between layers; updated).
        extend_splits, overlap_write, overlap_rotation: the layer's
            (:func:`oscar_kernels.serving.run_layer`).
        only: indices of ``steps`` to run for real, without dry runs (None: choose by dry runs).
        seconds: where given, host seconds of the dry runs, the compiles and the real runs are
            added under ``"dry"``, ``"compile"`` and ``"real"`` (a real run's time is its launches
            and any compile left, not its GPU work), the kernels compiled under ``"kernels"``.
        compile_workers: kernels compiled at once after the dry runs (1: one after another).
        compile_only: dry runs and compiles only, no step runs for real (what it would run is
            returned; ``done`` takes the compiled keys): the kernels of a later warm-up, compiled
            ahead (:func:`compile_ahead_engine`).
    Returns:
        The indices of the steps run for real.
    """
    from oscar_kernels.launch import compile_launches, record_launches

    done = set() if done is None else done
    lo, dev = cache.layout, cache.device
    page = lo.page_size
    need = max(sum(-(-(p + n) // page) - p // page for p, n in s) for s in steps) + 2
    scratch, pages = _scratch(lo, plan, need, dev)
    hk, d = lo.num_kv_heads, lo.head_dim
    n_max = max(sum(n for _, n in s) for s in steps)
    gen = torch.Generator(device=dev).manual_seed(0)
    q_all = torch.randn(n_max, num_heads, d, generator=gen, device=dev).to(torch.bfloat16)
    k_all = torch.randn(n_max, hk, d, generator=gen, device=dev).to(torch.bfloat16)
    v_all = torch.randn(n_max, hk, d, generator=gen, device=dev).to(torch.bfloat16)
    o_all = torch.empty_like(q_all)
    groups = plan.groups if plan is not None else 0

    def one(md: StepPlan) -> None:
        t = md.num_actual_tokens
        q, k, v = q_all[:t], k_all[:t], v_all[:t]
        # a decode step's first layer plans its launches, a later one runs the plans: with
        # overlap_rotation there the query rotation runs beside the window pass, a build of its own
        for _ in range(2 if md.all_decode and overlap_rotation else 1):
            run_layer(
                md,
                scratch,
                params,
                q,
                k,
                v,
                scale,
                backend,
                dense=dense,
                out=o_all[:t],
                extend_splits=extend_splits,
                overlap_write=overlap_write,
                overlap_rotation=overlap_rotation,
            )
        if pages is not None:
            b = md.seq_lens.shape[0]
            tables = torch.zeros(groups, b, window_table_width, dtype=torch.int32, device=dev)
            write_window_pages(scratch, params, k, v, md, pages, tables, backend)

    took = {"dry": 0.0, "compile": 0.0, "real": 0.0, "kernels": 0}
    t = time.perf_counter()
    if compile_only and only is not None:
        raise ValueError("run_warmup: compile_only chooses its steps by dry runs (only must be None)")
    todo = list(only) if only is not None else []
    mds: dict[int, StepPlan] = {}  # the dry-run steps to run for real: their metadata, once built
    if only is None:
        # dry runs first: the steps that launch a new specialisation, and one call of each, which
        # compile side by side before any step runs (a real launch compiles alone, ~3 s a kernel)
        calls: dict[tuple, tuple] = {}
        seen = set(done)
        for i in range(len(steps)):
            md = _step_metadata(steps[i], table_width, page, dev, _SCRATCH_SLOTS)
            with record_launches(dry=True, calls=calls) as keys:
                one(md)
            if not keys <= seen:
                seen |= keys
                todo.append(i)
                mds[i] = replace(md, bounds_checked=[False])
        took["dry"] = time.perf_counter() - t
        t = time.perf_counter()
        took["kernels"] = compile_launches((c for k, c in calls.items() if k not in done), compile_workers)
        took["compile"] = time.perf_counter() - t
        t = time.perf_counter()
        if compile_only:
            done |= seen
    for i in todo if not compile_only else ():
        md = mds.pop(i, None) or _step_metadata(steps[i], table_width, page, dev, _SCRATCH_SLOTS)
        with record_launches() as keys:
            one(md)
        done |= keys
    took["real"] = time.perf_counter() - t
    if seconds is not None:
        for k, v in took.items():
            seconds[k] = seconds.get(k, 0) + v
    return todo


# ---- the engine's warm-up: every distinct layer configuration of a worker's model, once ---------


def _signature(params: object) -> tuple:
    """What of a layer's parameters its kernels compile per: each tensor's shape, strides, dtype."""
    return tuple(
        (f.name, (tuple(v.shape), v.stride(), v.dtype) if isinstance(v, torch.Tensor) else v)
        for f in fields(params)  # type: ignore[arg-type]
        for v in [getattr(params, f.name)]
    )


def compile_workers() -> int:
    """Kernels the warm-up compiles at once: the CPUs this process may use, at most 8 (each
    compile is one thread, mostly outside the GIL; more threads than kernels of one start gain
    nothing, and tensor-parallel workers compile side by side on one host)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def warm_up_engine(worker: Any) -> None:
    """Compile the OSCAR kernels of every distinct layer configuration of ``worker``'s model
    (:mod:`oscar_vllm.warmup`), after vLLM's own warm-up and before it starts its JIT monitor.

    On where vLLM warms its own kernels (:func:`compat.jit_warmup_enabled`: by default, not with
    ``enforce_eager``); ``OSCAR_VLLM_WARMUP=1`` / ``0`` turns it on / off regardless. A failure
    is logged, never raised: without the warm-up the kernels compile at first use."""
    if not warmup_wanted(worker.vllm_config):
        return
    try:
        _warm_up(worker)
    except Exception as e:  # noqa: BLE001 - an optimisation: serving must not depend on it
        log.warning(
            "OSCAR: the kernel warm-up failed (%s: %s); kernels compile at first use", type(e).__name__, e
        )


def warmup_wanted(vllm_config: Any) -> bool:
    """The warm-up's switch: the ``warmup`` setting where set, else vLLM's own JIT warm-up setting."""
    on = settings_from(getattr(vllm_config, "additional_config", None), require_rotations=False).warmup
    return compat.jit_warmup_enabled(vllm_config) if on is None else on


def compile_ahead_engine(model_runner: Any) -> None:
    """Compile the kernels :func:`warm_up_engine` will launch before vLLM's CUDA-graph memory
    profile captures its graphs (``compat.after_profiling_kv_cache``): those captures launch OSCAR's
    decode kernels first, and each compiled there alone (H100: ~34 s of a 121-s cold start). Dry
    runs and a parallel compile only, on the profile's small KV cache (the layers' layouts and
    table widths are the engine's); the warm-up after vLLM's own then finds every kernel in
    Triton's in-memory cache. Where the warm-up is off, nothing; a failure is logged, never raised."""
    cfg = model_runner.vllm_config
    if not warmup_wanted(cfg):
        return
    try:
        _warm_up(_RunnerWorker(cfg, model_runner), compile_only=True)
    except Exception as e:  # noqa: BLE001 - an optimisation: serving must not depend on it
        why = f"{type(e).__name__}: {e}"
        log.warning("OSCAR: compiling the kernels ahead failed (%s); the warm-up compiles them", why)


class _RunnerWorker:
    """What :func:`_warm_up` reads of a worker, from its model runner."""

    def __init__(self, vllm_config: Any, model_runner: Any) -> None:
        self.vllm_config, self.model_runner = vllm_config, model_runner


def _warm_up(worker: Any, plans: WarmupPlans | None = None, compile_only: bool = False) -> None:
    cfg = worker.vllm_config
    widths = compat.block_table_widths(worker.model_runner)
    sc, max_len = cfg.scheduler_config, int(cfg.model_config.max_model_len)
    t0, seen = time.perf_counter(), set()
    jobs = []  # (configuration's key, its steps, run_warmup's arguments), in warm-up order
    for name, layer in cfg.compilation_config.static_forward_context.items():
        impl, kv = getattr(layer, "impl", None), getattr(layer, "kv_cache", None)
        kv = kv[0] if isinstance(kv, (list, tuple)) and kv else kv
        if not getattr(impl, "oscar_layer", False) or not isinstance(kv, torch.Tensor) or kv.numel() == 0:
            continue
        cache, params = impl._layer_state(layer, kv)
        lo = cache.layout
        width = widths.get(name) or -(-max_len // lo.page_size)
        w_width = 0
        if impl._plan is not None and impl.window_names:
            w_width = widths.get(impl.window_names[0]) or -(-max_len // impl._plan.block_size)
        key = (lo, impl._plan, width, w_width, impl.num_heads, impl._dense is not None, _signature(params))
        if key in seen:
            continue
        seen.add(key)
        steps = warmup_steps(
            lo.page_size,
            lo.recent_tokens,
            int(sc.max_num_batched_tokens),
            impl.max_seqs,
            width * lo.page_size,
            DENSE_MIN_QUERY if impl._dense is not None else None,
            split_tails=impl._splits != 1,
        )
        args = (cache, params, impl.num_heads, impl.scale, steps, width, impl._plan, w_width, impl._dense)
        opts = {"extend_splits": impl._splits, "overlap_write": impl._overlap,
                "overlap_rotation": impl._overlap_rotation}  # fmt: skip
        jobs.append(((key, impl._splits, impl._overlap, impl._overlap_rotation), steps, args, opts))
    if not jobs:
        return
    plans = WarmupPlans() if plans is None else plans
    dev = jobs[0][2][0].device
    plan_key = plans.key(dev, [(k, s) for k, s, _, _ in jobs])
    known = plans.load(plan_key, [len(s) for _, s, _, _ in jobs])
    done: set[tuple] = set()  # compile keys launched: layers that share kernels skip them
    seconds: dict[str, float] = {}
    workers = compile_workers()
    if compile_only:
        if known is not None:  # a start like an earlier one: Triton's disk cache has the kernels
            return
        for _, _, args, opts in jobs:
            run_warmup(*args, done=done, seconds=seconds, compile_workers=workers, compile_only=True, **opts)
        if dev.type == "cuda":  # the dry runs' scratch back to the device before vLLM measures again
            torch.cuda.empty_cache()
        log.info(
            "OSCAR: compiled %d kernels ahead of vLLM's CUDA-graph memory profile in %.1f s (dry runs "
            "%.1f s, %d at a time)",
            seconds.get("kernels", 0),
            time.perf_counter() - t0,
            seconds.get("dry", 0.0),
            workers,
        )
        return
    cached = cache_entries(triton_cache_dir())
    ran = [
        run_warmup(
            *args,
            done=done,
            only=None if known is None else known[i],
            seconds=seconds,
            compile_workers=workers,
            **opts,
        )
        for i, (_, _, args, opts) in enumerate(jobs)
    ]
    if known is None:
        plans.save(plan_key, ran)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    # what a warm start should show: few new kernels in Triton's cache, the time in the real steps
    compiled = cache_entries(triton_cache_dir()) - cached
    log.info(
        "OSCAR: warmed up its kernels (%d steps of %d layer configuration(s)%s) in %.1f s (dry runs "
        "%.1f s, %d kernels compiled %d at a time %.1f s, real steps %.1f s; %d new kernels in "
        "Triton's cache %s), so requests compile nothing (%s=0 skips it)",
        sum(map(len, ran)),
        len(jobs),
        ", the steps an earlier start chose" if known is not None else "",
        time.perf_counter() - t0,
        seconds.get("dry", 0.0),
        seconds.get("kernels", 0),
        workers,
        seconds.get("compile", 0.0),
        seconds.get("real", 0.0),
        compiled,
        triton_cache_dir(),
        WARMUP_ENV,
    )
