"""One layer of an engine step, run from the step's plan: write, attend, ring — launches only.

:func:`run_layer` is what an engine's attention backend calls in every layer's forward. The
step's first layer of each configuration goes through the validated public ops
(:func:`oscar_kernels.paged_write`, :func:`~oscar_kernels.decode_attention`,
:func:`~oscar_kernels.extend_attention`: shape checks, and the step's one bounds check, a host
synchronisation) and leaves its launch plans in the :class:`StepPlan`; every further layer runs
:func:`~oscar_kernels.run_write` / :func:`~oscar_kernels.run_decode` /
:func:`~oscar_kernels.run_extend` with them: no checks, no launch arithmetic, no host reads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from ..decode_attention import DecodePlan, decode_attention, plan_decode, run_decode
from ..extend_attention import extend_attention, run_extend
from ..extend_dense import DenseAttention
from ..launch import LaunchSequence
from ..layout import PagedKVCache
from ..paged_write import WritePlan, paged_write, plan_write, run_write
from ..params import ExpandedParams, LayerQuantParams, as_expanded
from .plan import StepPlan

__all__ = ["WindowOp", "run_layer", "join_layer", "beside", "write_step", "attend_step"]


class WindowOp(Protocol):
    """A window-slot operation every layer of a step runs (:attr:`StepPlan.before`,
    :attr:`StepPlan.after_attend`): a slot restored from a snapshot, rebuilt from INT2 pages, or
    captured into a snapshot. Called with the layer's cache, parameters and the step's un-rotated
    ``k``/``v`` (``None`` where the model stored them itself)."""

    def __call__(
        self, cache: PagedKVCache, params: ExpandedParams, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> None: ...


def _config(
    cache: PagedKVCache, params: ExpandedParams, q: torch.Tensor, scale: float, backend: str
) -> tuple:
    """What a layer's launch plans depend on besides the step's batch: its layout, query heads and
    dtype, scale, and which optional parameter fields it has (they select kernel variants)."""
    return (
        cache.layout,
        q.shape[1],
        q.dtype,
        scale,
        backend,
        params.has_mean,  # the write's HAS_MEAN (an artifact centres all layers or none; a caller may mix)
        params.k_feedback is None,
        params.v_feedback is None,
        params.k_rope_mean is None,
        params.rope_pairs,
    )


def _write_plan(
    plan: StepPlan, key: tuple, cache: PagedKVCache, ep: ExpandedParams, parts: str, backend: str,
    trigger: bool = False,
) -> WritePlan:  # fmt: skip
    wkey = (key, "write", parts, trigger)
    wp = plan.launches.get(wkey)
    if wp is None:
        n = plan.num_actual_tokens
        wp = plan.launches[wkey] = plan_write(cache, ep, n, parts, backend, trigger=trigger)
    return wp


def _write(
    plan: StepPlan, key: tuple, cache: PagedKVCache, ep: ExpandedParams, k: torch.Tensor, v: torch.Tensor,
    parts: str, backend: str, first: bool, checked: bool = False, trigger: bool = False,
) -> None:  # fmt: skip
    wp = _write_plan(plan, key, cache, ep, parts, backend, trigger)  # once per step: every layer launches it
    if first:
        write_step(
            cache,
            ep,
            k,
            v,
            plan,
            backend,
            parts=parts,
            check_bounds=False if (checked or plan.bounds_checked[0]) else None,
            write_plan=wp,
        )
        return
    run_write(
        wp,
        cache,
        ep,
        k,
        v,
        plan.slot_mapping,
        plan.positions,
        plan.seq_index,
        plan.seq_lens,
        plan.window_slots,
    )


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The second stream of ``device`` for a decode step's INT2 rows (``None`` off CUDA)."""
    if device.type != "cuda":
        return None
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SIDE:
        _SIDE[i] = torch.cuda.Stream(device=i)
    return _SIDE[i]


def _write_beside(
    plan: StepPlan, key: tuple, cache: PagedKVCache, ep: ExpandedParams, k: torch.Tensor, v: torch.Tensor,
    backend: str, first: bool, trigger: bool = False,
) -> None:  # fmt: skip
    """A decode step's write in two passes: the BF16 sink and ring rows (what this step's attention
    reads) on the current stream, then the INT2 rows (read only once a token has left the ring)
    on the second stream, which waits for the first pass and runs beside the attention —
    its error-feedback loop is ~20 µs of serial latency a layer on the H100, ~1 ms a step
    (lab/gpu_vllm/step_ablation.py). :func:`join_layer` joins it. Off CUDA both run in order."""
    _write(plan, key, cache, ep, k, v, "window", backend, first, trigger=trigger)
    side = _side_stream(cache.device)
    if side is None:
        _write(plan, key, cache, ep, k, v, "codes", backend, first, checked=True)
        return
    # in a CUDA-graph capture: a fork of the graph that join_layer closes (torch's multi-stream capture)
    side.wait_stream(torch.cuda.current_stream(cache.device))
    plan.side.append(side)
    # the pass reads k and v: held (not freed, so not reused) until it is joined, which may be a
    # layer later (defer_join)
    plan.keep.append((k, v))
    with torch.cuda.stream(side):
        _write(plan, key, cache, ep, k, v, "codes", backend, first, checked=True)


def join_layer(plan: StepPlan) -> None:
    """Make the current stream wait for the INT2 rows :func:`run_layer` left on the second stream
    (``defer_join``), and let go of the step tensors they read. A CUDA graph's capture refuses
    unjoined work: the step's last layer joins. Outside a capture a layer joins its own pass: an
    engine's piecewise graphs reuse the step's key and value memory once the layer returns."""
    while plan.side:
        side = plan.side.pop()
        torch.cuda.current_stream(side.device).wait_stream(side)
    plan.keep.clear()


@contextmanager
def beside(plan: StepPlan) -> Iterator[None]:
    """Run the block's launches beside the attention, on the second stream of the INT2 pass a
    :func:`run_layer` with ``defer_join`` left open (after that layer's window rows), and joined
    with it; with no pass open, on the current stream. vLLM runs the window records here: the
    step's attention does not read them."""
    if not plan.side:
        yield
        return
    with torch.cuda.stream(plan.side[-1]):
        yield


def run_layer(
    plan: StepPlan,
    cache: PagedKVCache,
    params: LayerQuantParams | ExpandedParams,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    scale: float,
    backend: str = "auto",
    dense: DenseAttention | None = None,
    out: torch.Tensor | None = None,
    extend_splits: int | str = 1,
    stored: bool = False,
    overlap_write: bool = True,
    defer_join: bool = False,
    overlap_rotation: bool = False,
) -> torch.Tensor:
    """One layer's step: the plan's ``before`` window ops, the write, attention, the plan's
    ``after_attend`` ops, and for an extend step the ring rows last — the windows apply per query
    token (``oscar_kernels.extend_attention``), and a chunk's ring rows overwrite rows its first
    queries still read.

    Args:
        plan: the step (:func:`oscar_kernels.serving.plan_step`).
        cache, params: the layer's cache and parameters (pass :class:`ExpandedParams`, expanded
            at load time: the compact form is expanded on every call).
        q: ``[T, H_q, d]``; k, v: ``[T, H_kv, d]`` un-rotated (after RoPE); ``k``/``v`` ``None``:
            the model stored this step's keys already (nothing written here).
        scale: softmax scale.
        backend: ``auto`` | ``triton`` | ``torch``.
        dense: an extend step's dense flash-attention kernel (:func:`oscar_kernels.extend_attention`).
        out: where a decode step writes (contiguous ``[T, H_q, d]`` in ``q.dtype``).
        extend_splits: :func:`oscar_kernels.extend_attention`'s ``num_splits``.
        stored: the model already stored this step's keys through the engine's pool (what the
            write before attention stores: everything in a decode step, the INT2 and sink rows in
            an extend step); an extend step's ring rows are still written here, after attention.
        overlap_write: a decode step writes its INT2 rows on a second CUDA stream beside its
            attention (:func:`_write_beside`; the cache ends bit for bit the same); false: one
            write before attention.
        defer_join: leave that second stream's pass unjoined for the caller, which may run more
            of the layer beside it (:func:`beside`; vLLM: the window records) and joins it with
            :func:`join_layer`, or — inside a CUDA graph's capture — leaves it to the next
            layer's ``run_layer``, which joins any pass still open before its own launches.
        overlap_rotation: with ``overlap_write``, a decode layer after the step's first runs its
            query rotation beside its window pass where PDL exists (:func:`run_decode`'s
            ``after_window_pass``; the engines' ``overlap_layers`` setting).
    Returns:
        ``[T, H_q, d]`` in ``q.dtype`` (``out`` for a decode step when given).
    """
    if plan.side:  # an earlier layer's INT2 pass (defer_join): long done, behind that layer's MLP
        join_layer(plan)
    lo = cache.layout
    ep = as_expanded(params, lo.num_kv_heads, lo.head_dim, cache.device)
    key = _config(cache, ep, q, scale, backend)
    first = (key, "decode" if plan.all_decode else "extend") not in plan.launches
    args = (cache, ep, q, k, v, scale, backend, dense, out, extend_splits, stored, overlap_write,
            overlap_rotation)  # fmt: skip
    try:
        if first:
            return _run_layer(plan, key, True, *args)
        # the step's further layers of this configuration: the launches of the one before, in order
        seq = plan.launches.get((key, "sequence"))
        if seq is None:
            seq = plan.launches[(key, "sequence")] = LaunchSequence()
        with seq:
            return _run_layer(plan, key, False, *args)
    finally:
        if not defer_join:
            join_layer(plan)


def _run_layer(
    plan: StepPlan, key: tuple, first: bool, cache: PagedKVCache, ep: ExpandedParams, q: torch.Tensor,
    k: torch.Tensor | None, v: torch.Tensor | None, scale: float, backend: str, dense: DenseAttention | None,
    out: torch.Tensor | None, extend_splits: int | str, stored: bool, overlap_write: bool,
    overlap_rotation: bool,
) -> torch.Tensor:  # fmt: skip
    for op in plan.before:
        op(cache, ep, k, v)
    has_kv = k is not None and v is not None
    if plan.all_decode:
        # the query rotation beside the window pass: the kernel just before it on this stream (not
        # in the step's first layer, which plans the launches through the validated ops)
        early = overlap_rotation and overlap_write and has_kv and not stored and not first
        early = early and not plan.after_attend
        if has_kv and not stored:
            if overlap_write:
                _write_beside(plan, key, cache, ep, k, v, backend, first, trigger=early)
            else:
                _write(plan, key, cache, ep, k, v, "all", backend, first)
        for op in plan.after_attend:  # a decode step's attention leaves the windows as they are
            op(cache, ep, k, v)
        if first:
            cb = None if not plan.bounds_checked[0] else False
            res = decode_attention(
                q, cache, ep, plan.block_table, plan.seq_lens, plan.window_slots, softmax_scale=scale,
                backend=backend, check_bounds=cb, out=out,
            )  # fmt: skip
            plan.launches[(key, "decode")] = plan_decode(
                cache, q.shape[1], plan.seq_lens.shape[0], plan.block_table.shape[1], scale, backend
            )
        else:
            dp: DecodePlan = plan.launches[(key, "decode")]
            bt, sl, ws = plan.block_table, plan.seq_lens, plan.window_slots
            res = run_decode(dp, q, cache, ep, bt, sl, ws, out, after_window_pass=early)
        plan.bounds_checked[0] = True
        return res
    if has_kv and not stored:
        _write(plan, key, cache, ep, k, v, "pages", backend, first)
    host_lens = (plan.query_lens_host, plan.seq_lens_bound_host) if plan.query_lens_host else None
    if first:
        res = attend_step(
            cache, ep, q, k, v, plan, scale, backend,
            check_bounds=None if not plan.bounds_checked[0] else False, dense=dense,
            extend_splits=extend_splits,
        )  # fmt: skip
        plan.launches[(key, "extend")] = True
    else:
        res = run_extend(
            q, k, v, cache, ep, plan.query_start_loc, plan.prefix_lens, plan.block_table, plan.window_slots,
            plan.max_query_len, scale, backend, dense=dense, host_lens=host_lens, num_splits=extend_splits,
        )  # fmt: skip
    for op in plan.after_attend:
        op(cache, ep, k, v)
    if has_kv:
        _write(plan, key, cache, ep, k, v, "ring", backend, first)
    plan.bounds_checked[0] = True
    return res


def write_step(
    cache: PagedKVCache,
    params: object,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepPlan,
    backend: str = "auto",
    parts: str = "all",
    check_bounds: bool | None = None,
    write_plan: WritePlan | None = None,
) -> None:
    """Quantise the step's ``k``/``v`` (``[T, H_kv, d]``) into ``cache`` (INT2 pages + BF16 windows)
    through the validated :func:`oscar_kernels.paged_write` (with ``write_plan``, the step's
    :func:`oscar_kernels.plan_write`, else planned there).

    ``parts`` as :func:`oscar_kernels.paged_write`: :func:`run_layer` writes ``"all"`` before
    a decode-only step, ``"pages"`` before and ``"ring"`` after an extend step.
    """
    paged_write(
        cache,
        params,
        k,
        v,
        md.slot_mapping,
        md.positions,
        md.seq_index,
        md.seq_lens,
        md.window_slots,
        backend=backend,
        parts=parts,
        check_bounds=check_bounds,
        plan=write_plan,
    )


def attend_step(
    cache: PagedKVCache,
    params: object,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    md: StepPlan,
    scale: float,
    backend: str = "auto",
    check_bounds: bool | None = None,
    dense: DenseAttention | None = None,
    out: torch.Tensor | None = None,
    extend_splits: int | str = 1,
) -> torch.Tensor:
    """Attention of the step's queries over the cache (after :func:`write_step`), through the
    validated ops.

    Decode kernel when every row is a one-token decode (everything written before);
    otherwise one extend call over the whole mixed batch (a decode row is a one-token
    chunk; extend and decode agree there, see oscar-kernels' tests), after the INT2 +
    sink write and before the ring write. Returns ``[T, H_q, d]`` in ``q.dtype``; a decode step
    writes it into ``out`` when given (contiguous, as ``q``), other steps return a new tensor.
    ``extend_splits``: :func:`oscar_kernels.extend_attention`'s ``num_splits``.
    """
    if md.all_decode:
        return decode_attention(
            q,
            cache,
            params,
            md.block_table,
            md.seq_lens,
            md.window_slots,
            softmax_scale=scale,
            backend=backend,
            check_bounds=check_bounds,
            out=out,
        )
    return extend_attention(
        q,
        k,
        v,
        cache,
        params,
        md.query_start_loc,
        md.prefix_lens,
        md.block_table,
        md.window_slots,
        md.max_query_len,
        softmax_scale=scale,
        backend=backend,
        check_bounds=check_bounds,
        dense=dense,
        host_lens=(md.query_lens_host, md.seq_lens_bound_host) if md.query_lens_host else None,
        num_splits=extend_splits,
    )
