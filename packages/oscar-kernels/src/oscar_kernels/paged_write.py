"""Public fused write op: rotate, clip, quantise, pack and store tokens into the cache."""

from __future__ import annotations

from typing import NamedTuple

import torch

from oscar_math import check

from ._backend import Backend, interpreting, use_triton
from ._validate import check_write_bounds
from .launch import launch
from .layout import PagedKVCache
from .params import ExpandedParams, LayerQuantParams, as_expanded
from .reference.paged_write import PART_ROWS, paged_write_ref

#: the last compiled kernel (diagnostics for benchmarks)
LAST_COMPILED: dict = {}

__all__ = [
    "paged_write", "WritePlan", "plan_write", "run_write", "WRITE_PARTS", "PART_ROWS", "FUSE_MAX_TOKENS",
]  # fmt: skip

#: the write's feedback prefetch is PTX (``prefetch.global.L1``): NVIDIA builds only
_PTX = torch.version.hip is None

#: what one :func:`paged_write` call can store (:data:`PART_ROWS`)
WRITE_PARTS = tuple(PART_ROWS)

#: token counts up to which K and V are written in one launch by default (decode steps, small batches)
FUSE_MAX_TOKENS = 64
#: a write of at most FEEDBACK_CHUNK_ROWS tokens runs its error-feedback loop on that many rows (the
#: program's real rows only, one a warp) instead of its whole token tile: the loop's cost is its
#: instructions, and with one row per warp each thread holds one element of a quarter, not four
#: of mostly padding rows (a decode step writes one token a sequence into a 16-token tile). One
#: chunk only: on the H100 a one-token write's kernel went 23.0 -> 18.1 us, but 8 tokens in two
#: chunks 22.8 -> 24.2 us (graph replay 33.5 us against the whole tile's 31.6; NOTES_performance_runs)
FEEDBACK_CHUNK_ROWS = 4
#: writes of FEEDBACK_CHUNK_ROWS + 1 .. FEEDBACK_CHUNK_MAX_TOKENS tokens run one chunk of
#: FEEDBACK_WIDE_CHUNK_ROWS rows on as many warps (one row a warp again; offline sm_90 the same loop
#: as the 4-row chunk). Off (4) until measured: for a decode step of 5-8 sequences, 8 would trade
#: the whole 16-token tile on 4 warps (22.8 us on the H100) for one 8-row chunk on 8 warps
#: (``lab/gpu_vllm/ab.sh write`` with this raised to 8 is the A/B)
FEEDBACK_CHUNK_MAX_TOKENS = 4
FEEDBACK_WIDE_CHUNK_ROWS = 8


def _validate(cache: PagedKVCache, key, value, slot_mapping, positions, seq_index, seq_lens, window_slots):
    lo = cache.layout
    n = key.shape[0] if key.dim() == 3 else -1
    exp = (n, lo.num_kv_heads, lo.head_dim)
    check(
        key.dim() == 3 and tuple(key.shape) == exp,
        "shape of key",
        "[N, num_kv_heads, head_dim] " + str(exp),
        tuple(key.shape),
    )
    check(tuple(value.shape) == exp, "shape of value", exp, tuple(value.shape))
    check(
        key.is_floating_point() and value.is_floating_point(),
        "dtype of key/value",
        "floating",
        (key.dtype, value.dtype),
    )
    for name, t in (("slot_mapping", slot_mapping), ("positions", positions), ("seq_index", seq_index)):
        check(t.dim() == 1 and t.shape[0] == n, f"shape of {name}", f"[{n}]", tuple(t.shape))
    check(seq_lens.dim() == 1, "shape of seq_lens", "[B]", tuple(seq_lens.shape))
    check(
        tuple(window_slots.shape) == tuple(seq_lens.shape),
        "shape of window_slots",
        tuple(seq_lens.shape),
        tuple(window_slots.shape),
    )
    for name, t in (
        ("key", key),
        ("value", value),
        ("slot_mapping", slot_mapping),
        ("positions", positions),
        ("seq_index", seq_index),
        ("seq_lens", seq_lens),
        ("window_slots", window_slots),
    ):
        check(t.device == cache.device, f"device of {name}", cache.device, t.device)
    for name, t in (
        ("slot_mapping", slot_mapping),
        ("positions", positions),
        ("seq_index", seq_index),
        ("seq_lens", seq_lens),
        ("window_slots", window_slots),
    ):
        check(not t.is_floating_point(), f"dtype of {name}", "an integer dtype", t.dtype)
    check(
        key.stride(-1) == 1 and value.stride(-1) == 1,
        "stride(-1) of key/value",
        1,
        (key.stride(-1), value.stride(-1)),
    )


def paged_write(
    cache: PagedKVCache,
    params: LayerQuantParams | ExpandedParams,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    seq_index: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
    backend: Backend | str = "auto",
    precise: bool = False,
    block_t: int | None = None,
    num_warps: int | None = None,
    check_bounds: bool | None = None,
    parts: str = "all",
    fuse: bool | None = None,
    plan: WritePlan | None = None,
) -> None:
    """Quantise ``N`` new tokens into ``cache`` in place (one fused kernel for K and V, or one each).

    Every token goes to its INT2 slot; a token also goes to its sequence's BF16 sink
    row when ``position < sink`` and to its ring row ``position % recent`` when
    ``position >= max(sink, seq_len - recent)``.

    ``parts`` splits the write around a prefill chunk's attention (``docs/kernels.md``,
    "Order of writes"): ``"pages"`` stores the INT2 rows and the sink rows only,
    ``"ring"`` the ring rows only, ``"all"`` both. A chunk writes ``"pages"`` before
    :func:`oscar_kernels.extend_attention` (which reads the chunk's INT2 rows and sink rows)
    and ``"ring"`` after it: the chunk's ring rows overwrite the rows of positions
    ``p - recent`` that the chunk's first queries still read in BF16. A decode step (one token
    per sequence) writes ``"all"`` before attention, or ``"window"`` (the sink and ring rows,
    which its attention reads) before it and ``"codes"`` (the INT2 rows, which it does not read:
    a token is in the ring while it is that recent) beside it on a second stream
    (:func:`oscar_kernels.serving.run_layer`). :data:`PART_ROWS` lists what each stores.

    Args:
        cache: the layer's cache.
        params: the layer's rotations / mean / clip ratios / error-feedback matrices (when
            given, the INT2 codes are those of ``oscar_math.quantize_int2_feedback``) / pre-RoPE
            key mean (format version 3: the INT2 key row of position ``p`` quantises
            ``(k − k_mean − RoPE_p(m)) @ R_K``, the BF16 sink/ring rows stay
            ``(k − k_mean) @ R_K``; :mod:`oscar_math.rope_center`).
        key, value: ``[N, H_kv, d]`` un-rotated (after RoPE), any float dtype.
        slot_mapping: ``[N]`` flat INT2 slot ``page * page_size + offset``; ``< 0`` = skip (padding).
        positions: ``[N]`` position of each token in its sequence (also the RoPE position
            of the pre-RoPE key mean; the kernel's angle ``p·θ`` is one float32 product).
        seq_index: ``[N]`` which of the ``B`` sequences each token belongs to.
        seq_lens: ``[B]`` sequence lengths *after* this write.
        window_slots: ``[B]`` row of the window pools owned by each sequence.
        backend: ``auto`` | ``triton`` | ``torch``.
        precise: Triton only: full-fp32 (``ieee``) rotation instead of tf32.
        block_t, num_warps: Triton tokens per program and warps. Default: 128 for d <= 128, else
            32; and 32 for a tensor written with error-feedback codes, whose d-step loop keeps more
            per-row state live (H200, Qwen3-8B shape, 8192 tokens, K with feedback + V plain:
            2.98 ms with both at 32, 6.35 ms with both at 128; benchmarks/write_speed.py,
            docs/kernels.md). Warps: 4; a key tensor centred by a pre-RoPE mean without feedback
            defaults to 64 tokens on 8 warps (fewest register spills of the in-kernel RoPE).
        check_bounds: check that slots, sequence indices, positions and window rows of the
            written tokens are in range (one host synchronisation; ``None`` =
            :func:`oscar_kernels.set_bounds_checks`'s setting, off while a CUDA graph is
            captured). Raises :class:`OscarError`.
        parts: ``"all"`` | ``"pages"`` | ``"ring"`` | ``"window"`` | ``"codes"`` (see above).
        fuse: Triton only: K and V in one launch (``paged_write_kv_kernel``), their programs side by
            side. ``None``: ``parts`` ``"all"``, ``"window"`` or ``"codes"`` with at most
            :data:`FUSE_MAX_TOKENS` tokens, where the write is latency (a decode step: one token
            per sequence). The results are the same either way.
        plan: a :func:`plan_write` of this write to launch with (an engine step plans once for all
            its layers); ``None``: planned here from the arguments above.
    """
    check(parts in WRITE_PARTS, "parts", f"one of {WRITE_PARTS}", parts)
    _validate(cache, key, value, slot_mapping, positions, seq_index, seq_lens, window_slots)
    check_write_bounds(cache, slot_mapping, positions, seq_index, seq_lens, window_slots, check_bounds)
    lo = cache.layout
    ep = as_expanded(params, lo.num_kv_heads, lo.head_dim, cache.device)
    if plan is None:
        plan = plan_write(cache, ep, key.shape[0], parts, backend, precise, block_t, num_warps, fuse)
    check(
        (plan.num_tokens, plan.parts) == (key.shape[0], parts),
        "plan (tokens, parts)",
        (key.shape[0], parts),
        (plan.num_tokens, plan.parts),
    )
    run_write(plan, cache, ep, key, value, slot_mapping, positions, seq_index, seq_lens, window_slots)


class WritePlan(NamedTuple):
    """How :func:`paged_write` launches for ``num_tokens`` tokens of one layer configuration
    (:func:`plan_write`): built once per engine step, reused by every layer with the same
    parameters' structure (:func:`run_write`)."""

    num_tokens: int
    parts: str
    use_triton: bool
    precision: str
    k_tile: tuple[int, int]  # (tokens per program, warps)
    v_tile: tuple[int, int]
    fuse: bool  # K and V in one launch (requested; :func:`run_write` also needs shared strides)
    #: float32 scratch of the error-feedback programs (a BLOCK_T x d tile each; ``kernels/
    #: paged_write.py``'s ``_stage``), one per step: its layers write one after another
    scratch: torch.Tensor | None = None
    #: rows of the feedback loop at a time (0: the whole token tile; FEEDBACK_CHUNK_ROWS for small writes)
    feedback_rows: int = 0
    #: a window pass that lets the next kernel, launched as its programmatic dependent, start at
    #: once (``run_decode``'s ``after_window_pass``; PDL devices only)
    trigger: bool = False


def plan_write(
    cache: PagedKVCache,
    params: ExpandedParams,
    num_tokens: int,
    parts: str = "all",
    backend: Backend | str = "auto",
    precise: bool = False,
    block_t: int | None = None,
    num_warps: int | None = None,
    fuse: bool | None = None,
    trigger: bool = False,
) -> WritePlan:
    """The launch of a :func:`paged_write` of ``num_tokens`` tokens (arguments as there): tiles,
    warps, one or two launches. Host arithmetic on sizes and on which of ``params``' optional
    fields are set only. ``trigger`` (``parts="window"``): the kernel lets a programmatic dependent
    start at once (``paged_write_kv_kernel``'s ``TRIGGER``) where PDL exists."""
    lo = cache.layout
    triton_on = use_triton(cache.device, backend)
    prec = "ieee" if (precise or interpreting()) else "tf32"
    if not triton_on:
        return WritePlan(num_tokens, parts, False, prec, (0, 0), (0, 0), False)
    has_rope = params.k_rope_mean is not None
    kcfg = _tile_for(params.k_feedback is not None, has_rope, num_tokens, lo.head_dim, block_t, num_warps)
    vcfg = _tile_for(params.v_feedback is not None, False, num_tokens, lo.head_dim, block_t, num_warps)
    if fuse is None:
        # decode steps only: a chunk's split passes keep their two launches, so the set of compiled
        # kernels of a step does not depend on how many sequences share it (the warm-up's steps)
        fuse = parts in ("all", "window", "codes") and num_tokens <= FUSE_MAX_TOKENS
    scratch, fb_rows = None, 0
    if (params.k_feedback is not None or params.v_feedback is not None) and PART_ROWS[parts][0]:
        # (a constexpr of the kernel: set only where a feedback loop runs, so plain writes keep one build)
        fb_rows = _feedback_rows(num_tokens)
        if fb_rows and num_warps is None:  # one row a warp
            kcfg = (kcfg[0], fb_rows) if params.k_feedback is not None else kcfg
            vcfg = (vcfg[0], fb_rows) if params.v_feedback is not None else vcfg
        # every program of the larger launch (K and V side by side) its own tile of the padded tokens
        bt = max(kcfg[0], vcfg[0])
        rows = -(-num_tokens // bt) * bt
        size = rows * 2 * lo.num_kv_heads * lo.head_dim
        scratch = torch.empty(size, dtype=torch.float32, device=cache.device)
    if trigger:
        from .decode_attention import pdl_available

        trigger = parts == "window" and pdl_available(cache.device)
    return WritePlan(num_tokens, parts, True, prec, kcfg, vcfg, bool(fuse), scratch, fb_rows, trigger)


def _feedback_rows(n: int) -> int:
    """Rows a chunk of the feedback loop of an ``n``-token write (0: the whole token tile)."""
    if n <= FEEDBACK_CHUNK_ROWS:
        return FEEDBACK_CHUNK_ROWS
    return FEEDBACK_WIDE_CHUNK_ROWS if n <= FEEDBACK_CHUNK_MAX_TOKENS else 0


def run_write(
    plan: WritePlan,
    cache: PagedKVCache,
    ep: ExpandedParams,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    positions: torch.Tensor,
    seq_index: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
) -> None:
    """One layer's write as ``plan`` says, without :func:`paged_write`'s checks (the caller
    checked the step's tensors once): launches only."""
    lo = cache.layout
    n, parts = plan.num_tokens, plan.parts
    codes, sink, ring = PART_ROWS[parts]
    if n == 0 or not (codes or (sink and lo.sink_tokens) or (ring and lo.recent_tokens)):
        return
    if not plan.use_triton:
        paged_write_ref(
            cache, ep, key, value, slot_mapping, positions, seq_index, seq_lens, window_slots, parts
        )
        return
    kt = _Tensor(
        key, ep.k_rotation, ep.k_feedback, ep.k_clip, ep.has_mean, ep.k_rope_mean is not None, "k", cache
    )
    vt = _Tensor(value, ep.v_rotation, ep.v_feedback, ep.v_clip, False, False, "v", cache)
    idx = (slot_mapping, positions, seq_index, seq_lens, window_slots)
    if plan.fuse and _shared_strides(cache, kt, vt):
        # one launch, K and V programs side by side: the smaller tile, the larger warp count
        bt, warps = min(plan.k_tile[0], plan.v_tile[0]), max(plan.k_tile[1], plan.v_tile[1])
        _launch_kv(
            cache, ep, kt, vt, idx, n, bt, warps, plan.precision, parts, plan.scratch, plan.feedback_rows,
            plan.trigger,
        )  # fmt: skip
        return
    for t, (bt, warps) in ((kt, plan.k_tile), (vt, plan.v_tile)):
        _launch_one(cache, ep, t, idx, n, bt, warps, plan.precision, parts, plan.scratch, plan.feedback_rows)


class _Tensor(NamedTuple):
    """What differs between the K and the V write."""

    x: torch.Tensor
    rot: torch.Tensor
    fb: torch.Tensor | None
    alpha: torch.Tensor
    has_mean: bool
    has_rope: bool
    name: str
    cache: PagedKVCache

    def field(self, what: str) -> torch.Tensor:
        return getattr(self.cache, f"{self.name}_{what}")


def _tile_for(
    feedback: bool, has_rope: bool, n: int, head_dim: int, block_t: int | None, num_warps: int | None
) -> tuple[int, int]:
    """Tokens per program and warps of one tensor's write (with error-feedback codes or not, with
    the pre-RoPE key mean or not)."""
    import triton

    # the feedback loop runs faster on smaller token blocks (register pressure; see docstring);
    # the in-kernel RoPE_p(m) of a plain key tensor spills least at 64 tokens on 8 warps
    # (ptxas for sm_90: 160 B against 2144 B at 128 tokens on 4)
    rope_plain = has_rope and not feedback
    if block_t is not None:
        bt = block_t
    else:
        bt = 32 if feedback else (64 if rope_plain else (128 if head_dim <= 128 else 32))
        # a decode step writes one token per sequence: a 128-token tile per KV head rotated
        # 128 rows for each real one (H200, Qwen3-8B shape, batch 1: 20 us per launch, 40% of
        # OSCAR's device time in a 2k decode step); tiles of the next power of two >= n
        # (>= 16 for tl.dot), compiled for every CUDA-graph capture size at capture
        bt = min(bt, max(16, triton.next_power_of_2(n)))
    warps = num_warps if num_warps is not None else (8 if rope_plain else 4)
    return bt, warps


def _shared_strides(cache: PagedKVCache, kt: _Tensor, vt: _Tensor) -> bool:
    """Whether the K and V operands have the strides the one-launch kernel passes once: the caches
    (always for :func:`allocate_cache`; an engine's views may differ) and the rotations (a
    per-layer rotation broadcasts with stride 0 over heads, a per-head one does not)."""
    return (
        kt.rot.stride() == vt.rot.stride()
        and cache.k_scale.stride() == cache.k_zero.stride()
        and all(
            getattr(cache, f"k_{f}").stride() == getattr(cache, f"v_{f}").stride()
            for f in ("codes", "scale", "zero", "sink", "recent")
        )
    )


def _launch_kv(
    cache: PagedKVCache, ep: ExpandedParams, kt: _Tensor, vt: _Tensor, idx: tuple, n: int, bt: int,
    warps: int, prec: str, parts: str, scratch: torch.Tensor | None, fb_rows: int, trigger: bool = False,
) -> None:  # fmt: skip
    import triton

    from .kernels.paged_write import paged_write_kv_kernel

    lo = cache.layout
    kwargs = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": warps, "PREFETCH": _PTX}
    if trigger:  # the query rotation may start beside it (WritePlan.trigger)
        kwargs["TRIGGER"] = True
    codes, scale, sink, ring = cache.k_codes, cache.k_scale, cache.k_sink, cache.k_recent
    LAST_COMPILED["paged_write"] = launch(
        paged_write_kv_kernel,
        (triton.cdiv(n, bt), 2 * lo.num_kv_heads),
        kt.x, kt.x.stride(0), kt.x.stride(1), vt.x, vt.x.stride(0), vt.x.stride(1),
        kt.rot, vt.rot, kt.rot.stride(0), kt.rot.stride(1),
        ep.k_mean, ep.k_mean.stride(0),
        *_rope_args(ep, kt.has_rope),
        kt.alpha, vt.alpha,
        *_fb_args(kt), *_fb_args(vt),
        *idx,
        cache.k_codes, cache.v_codes, codes.stride(0), codes.stride(1), codes.stride(2),
        cache.k_scale, cache.k_zero, cache.v_scale, cache.v_zero,
        scale.stride(0), scale.stride(1), scale.stride(2),
        cache.k_sink, cache.v_sink, sink.stride(0), sink.stride(1), sink.stride(2),
        cache.k_recent, cache.v_recent, ring.stride(0), ring.stride(1), ring.stride(2),
        n, lo.page_size, kt.rot if scratch is None else scratch,
        NUM_KV_HEADS=lo.num_kv_heads, HEAD_DIM=lo.head_dim, GROUP=lo.group, SINK=lo.sink_tokens,
        RECENT=lo.recent_tokens, HAS_MEAN=kt.has_mean,
        K_FEEDBACK=kt.fb is not None, V_FEEDBACK=vt.fb is not None,
        HAS_ROPE=kt.has_rope, **_part_flags(parts), BLOCK_T=bt,
        DOT_PRECISION=prec, FB_ROWS=min(fb_rows, bt), **kwargs,
    )  # fmt: skip


def _part_flags(parts: str) -> dict[str, bool]:
    codes, sink, ring = PART_ROWS[parts]
    return {"WRITE_PAGES": codes, "WRITE_SINK": sink, "WRITE_RING": ring}


def _rope_args(ep: ExpandedParams, has_rope: bool) -> tuple:
    # pre-RoPE mean and inverse frequencies: valid pointers either way, read only with HAS_ROPE
    if has_rope:
        return ep.k_rope_mean, ep.k_rope_mean.stride(0), ep.k_rope_inv_freq
    return ep.k_mean, 0, ep.k_mean


def _fb_args(t: _Tensor) -> tuple:
    # a valid pointer either way; read only with HAS_FEEDBACK
    return (t.rot, 0, 0, 0) if t.fb is None else (t.fb, *t.fb.stride())


def _launch_one(
    cache: PagedKVCache, ep: ExpandedParams, t: _Tensor, idx: tuple, n: int, bt: int, warps: int, prec: str,
    parts: str, scratch: torch.Tensor | None, fb_rows: int,
) -> None:  # fmt: skip
    import triton

    from .kernels.paged_write import paged_write_kernel

    lo = cache.layout
    kwargs = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": warps, "PREFETCH": _PTX}
    codes, scale, zero, sink, ring = (t.field(f) for f in ("codes", "scale", "zero", "sink", "recent"))
    LAST_COMPILED["paged_write"] = launch(
        paged_write_kernel,
        (triton.cdiv(n, bt), lo.num_kv_heads),
        t.x, t.x.stride(0), t.x.stride(1),
        t.rot, t.rot.stride(0), t.rot.stride(1),
        ep.k_mean, ep.k_mean.stride(0),
        *_rope_args(ep, t.has_rope),
        t.alpha,
        *_fb_args(t),
        *idx,
        codes, codes.stride(0), codes.stride(1), codes.stride(2),
        scale, zero, scale.stride(0), scale.stride(1), scale.stride(2),
        sink, sink.stride(0), sink.stride(1), sink.stride(2),
        ring, ring.stride(0), ring.stride(1), ring.stride(2),
        n, lo.page_size, t.rot if scratch is None else scratch,
        HEAD_DIM=lo.head_dim, GROUP=lo.group, SINK=lo.sink_tokens, RECENT=lo.recent_tokens,
        HAS_MEAN=t.has_mean, HAS_FEEDBACK=t.fb is not None, HAS_ROPE=t.has_rope,
        **_part_flags(parts), BLOCK_T=bt, DOT_PRECISION=prec,
        FB_ROWS=min(fb_rows, bt), **kwargs,
    )  # fmt: skip
