"""Public decode attention op: split-K flash-decoding over INT2 pages + BF16 windows."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

from oscar_math import check

from ._backend import Backend, KernelUnavailableError, dot_dtype, unpack_mode, use_triton
from ._validate import check_decode_bounds, check_index_tensor, check_queries
from .launch import launch
from .layout import PagedKVCache
from .params import ExpandedParams, LayerQuantParams, as_expanded
from .reference.attention import decode_attention_ref


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch/output allocation (a hook: the GPU check script poisons it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


#: the last compiled kernels (diagnostics for benchmarks: registers, spills, PTX)
LAST_COMPILED: dict = {}

__all__ = [
    "decode_attention",
    "DecodePlan",
    "plan_decode",
    "run_decode",
    "choose_num_splits",
    "gluon_unavailable_reason",
    "DECODE_IMPLS",
    "DecodeTuning",
    "DEFAULT_TUNING",
]

#: decode kernels: ``auto`` (``gluon`` where it serves the call, else ``tl``), ``gluon`` (Triton
#: Gluon, NVIDIA sm_80+, codes loaded straight into ``mma`` fragments; ``GROUP == HEAD_DIM``,
#: ``HEAD_DIM % 128 == 0``; ``OSCAR_GLUON_DECODE=0`` switches it off for ``auto``) or ``tl``
#: (portable ``tl.dot`` kernel, any group size, also runs under the Triton interpreter)
DECODE_IMPLS = ("auto", "gluon", "tl")

#: launch defaults per kernel: (block_n, num_warps, programs_per_sm). ``programs_per_sm`` is
#: the kernel's residency (Gluon: 164-168 registers, 65536 / (168·32) = 12 one-warp programs
#: per SM), which :func:`choose_num_splits` fills in whole waves. Gluon: H200 sweeps
#: (docs/performance.md, lab/kernel_studies/decode_sweep.py)
_DEFAULTS = {"gluon": (32, 1, 12), "tl": (128, 4, 8)}


@dataclass(frozen=True)
class DecodeTuning:
    """The decode op's launch rules: what the H200 sweeps chose (docs/performance.md,
    lab/kernel_studies/decode_sweep.py). The defaults are what the product runs; an A/B run passes
    another instance (``decode_attention(..., tuning=replace(DEFAULT_TUNING, use_pdl=False))``).

    Attributes:
        max_splits: most INT2 splits per (sequence, KV head); 198 is one full wave of the Gluon
            kernel at batch 1 on the H200 (8 KV heads), its best split count at 128k (72 µs; 264:
            79 µs).
        use_pdl: programmatic dependent launch where :func:`pdl_available`.
        merge_preload_max_d: the merge loads the ``[d, d]`` value rotation before it waits for the
            split kernel (``PRELOAD``, 8 warps) where ``d <=`` this (``0``: never).
        window_tokens: BF16 window tokens per Gluon program (``None``: the kernel's
            ``WINDOW_TOKENS_PER_PROGRAM``).
        rotate_rows_per_program: output elements per program of the query rotation (``0``: one
            program per query row).
        rotate_rows_small: programs of this many outputs where ``rotate_rows_per_program`` would
            not fill the SMs (batch 1: 128 programs for 132 SMs; 8k x 1 op 18.6 vs 19.9 µs, 32k x 1
            28.4 vs 31.1; at batch 8 16-output programs are 1 µs slower); ``0``: never.
        async_stages: Gluon: a ``cp.async`` ring of this many shared-memory stages for the INT2
            tiles instead of the register prefetch (``0``: never), by :func:`async_ring_mode`.
        async_min_tiles: the ring is used when a split is at least this many INT2 tiles long (its
            prologue of ``async_stages - 1`` tiles then pays off; the ring made the 8k x 1 op
            3.6 µs slower with 4-tile splits).
        async_wide_min_waves: the ring's code copies are 16 bytes per thread where the split
            programs fill at least this many waves of 12 per SM (``0``: always; ``None``: never).
            The 16-byte build has 128 registers (16 programs per SM): faster where there are
            programs to fill 16 per SM (128k x 8: 278 vs 287 µs), slower where the split rule made
            one wave of 12 (32k x 8: 104 vs 84 µs).
        rope_addition_max_elements, rope_addition_min_block_n: Gluon kernel, the pre-RoPE mean's
            score term by angle addition (``ROPE_MODE`` 2: a loop-invariant ``[block_n, 2·P]``
            operand) where that operand has at most this many elements and tiles are at least this
            many tokens, else one reduced angle per (token, pair slot) and tile (``ROPE_MODE`` 1).
            H200, R = 8: addition 300 vs 367 µs at 128k x 8 (64-token tiles), but 20.4 vs 19.3 µs
            at 8k x 1 and 111.1 vs 110.0 µs at 32k x 8 (32-token tiles).
        long_split_tokens: 64-token Gluon tiles (``block_n`` left to the op) where the 16-byte ring
            is used and the 32-token launch's splits are at least this long (128k x 8: 257 vs 278
            µs split + merge).
        merge_impl: the split merge of :func:`merge_partials`: ``"v2"`` (``merge_cols_kernel``, ``d /
            merge_block_d`` programs per query row, then ``unrotate_rows_kernel`` with ``R_V`` read
            per KV head and row block, issue #38) or ``"v1"`` (``merge_splits_kernel``: one program
            per query row, partials in 64-partial steps, the row's own ``[d, d]`` ``R_V`` read).
        merge_block_d: v2: output columns per merge program (a power of two dividing ``d``).
        merge_chunk: v2: partials per merge step (one compile for every split count). 128: the
            ``[128, 32]`` float32 tile is 64 registers a thread at 4 warps (sm_90 ptxas), 8 programs
            per SM, one wave for the 1024 programs of batch 8 x 32 query heads; 256 (one step for
            every decode split count, ``max_splits`` + windows) is 117 registers, 4 per SM, two
            waves at batch 8, but one step instead of two at 1 x 130k (208 partials).
        merge_num_warps: v2: warps per merge program and per un-rotation program.
        merge_rotate_rows: v2: query rows (of one KV head's GQA group x batch) per un-rotation
            program (a power of two).
        merge_rotate_cols: v2: output columns per un-rotation program (a power of two).
    """

    max_splits: int = 256
    use_pdl: bool = True
    merge_preload_max_d: int = 128
    window_tokens: int | None = None
    rotate_rows_per_program: int = 32
    rotate_rows_small: int = 16
    async_stages: int = 3
    async_min_tiles: int = 16
    async_wide_min_waves: float | None = 2
    rope_addition_max_elements: int = 1024
    rope_addition_min_block_n: int = 64
    long_split_tokens: int = 1024
    # v1: H100 2026-12-06 (lab/results/kernels/h100_2026-12-06/kernel_speed_merge_v2.json), the decode
    # op with v2 took 18.6 / 61.6 / 111.7 us at 1x2k / 1x130k / 8x32k against v1's 15.7 / 60.3 / 95.5:
    # v2's merge kernel is fast (2.5-3.4 us) but its separate un-rotation kernel costs 6-33 us
    merge_impl: str = "v1"
    merge_block_d: int = 32
    merge_chunk: int = 128
    merge_num_warps: int = 4
    merge_rotate_rows: int = 16
    merge_rotate_cols: int = 16


#: the launch rules the product runs (what ``tuning=None`` means, looked up at call time)
DEFAULT_TUNING = DecodeTuning()


def _tuning(tuning: DecodeTuning | None) -> DecodeTuning:
    return DEFAULT_TUNING if tuning is None else tuning


def pdl_available(device: torch.device, tuning: DecodeTuning | None = None) -> bool:
    """Whether the decode op's kernels launch as programmatic dependents (PDL, sm_90+): each
    kernel starts while the one before it drains and waits (``griddepcontrol.wait``) only
    before reading that kernel's output. Host-side facts only (CUDA-graph safe)."""
    tuning = _tuning(tuning)
    from ._backend import interpreting

    if interpreting() or device.type != "cuda" or torch.version.hip is not None or not tuning.use_pdl:
        return False
    return _pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    """Device and Triton facts behind :func:`pdl_available`, once per device (host overhead)."""
    from .kernels import attention

    if attention.gdc_wait is None or torch.cuda.get_device_capability(device_index)[0] < 9:
        return False
    from triton.backends.nvidia.compiler import CUDAOptions

    return "launch_pdl" in CUDAOptions.__dataclass_fields__


def async_ring_mode(
    max_len: int,
    sink: int,
    recent: int,
    num_splits: int,
    block_n: int,
    programs: int,
    sms: int,
    tuning: DecodeTuning | None = None,
) -> tuple[int, bool]:
    """``(stages, wide)`` of the Gluon kernel's ``cp.async`` ring for a launch (``stages`` 0:
    register prefetch; ``wide``: 16-byte code copies).

    Host-known sizes only (``max_len`` = block-table width · page size, as for
    :func:`choose_num_splits`; ``programs`` = sequences · KV heads · splits), so the choice is
    the same on every step and under graph capture: the longest split's tile count, as the
    kernel cuts the INT2 range.
    """
    tuning = _tuning(tuning)
    if tuning.async_stages <= 0:
        return 0, False
    per = -(-max(0, max_len - sink - recent) // max(1, num_splits))
    if -(-per // block_n) < tuning.async_min_tiles:
        return 0, False
    wave = _DEFAULTS["gluon"][2] * sms
    wide_waves = tuning.async_wide_min_waves
    return tuning.async_stages, wide_waves is not None and programs >= wide_waves * wave


def gluon_block_n(
    batch: int,
    layout,
    max_len: int,
    device: torch.device,
    programs_per_sm: int,
    tuning: DecodeTuning | None = None,
) -> int:
    """Tile size of the Gluon kernel when the caller leaves it open: 32 tokens, or 64 where the
    32-token launch would use the 16-byte ring on splits of >= ``tuning.long_split_tokens``."""
    tuning = _tuning(tuning)
    bn = _DEFAULTS["gluon"][0]
    if layout.page_size % 64 or layout.sink_tokens % 64:  # 64-token tiles would cross pages
        return bn
    ns = choose_num_splits(batch, layout.num_kv_heads, max_len, device, bn, programs_per_sm, tuning)
    progs = batch * layout.num_kv_heads * ns
    sink, recent = layout.sink_tokens, layout.recent_tokens
    stages, wide = async_ring_mode(max_len, sink, recent, ns, bn, progs, _num_sms(device), tuning)
    per = -(-max(0, max_len - sink - recent) // ns)
    return 64 if stages and wide and per >= tuning.long_split_tokens else bn


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_len: int,
    device: torch.device,
    block_n: int = 64,
    programs_per_sm: int = 4,
    tuning: DecodeTuning | None = None,
) -> int:
    """Splits of the INT2 range per (sequence, KV head), from host-known sizes only.

    What the H200 sweeps of the Gluon kernel show (docs/performance.md):

    * the best count grows like ``2·sqrt(max_len / (batch·H_kv))`` — every split adds a
      prologue and a partial to merge, every token per split a step of a serial tile loop
      (batch 1: 8k → 64, 32k → 128, 128k → 256 before the two rules below);
    * the programs should spread evenly over the SMs: counts that make ``batch·H_kv·splits`` a
      multiple of the SM count win (132 vs 128 splits at 128k × 1: 75 vs 92 µs), so the count
      is rounded to such a multiple once it is at least half of one;
    * a second, partial wave of resident programs (``programs_per_sm`` per SM) costs a whole
      split's time: 1–2 waves are cut back to one when splits are long (≥ 384 tokens; 264 →
      198 splits at 128k × 1: 79 → 72 µs, 33 → 24 at 32k × 8: 126 → 110 µs; at 8k × 8 the
      short splits of the second wave cost less than fewer splits would: 33 splits 53–55 µs,
      24 splits 55–60 µs).

    Never a split shorter than two tiles, at most ``tuning.max_splits``. Depends on ``max_len``
    (``block_table.shape[1] * page_size``), not on the actual lengths, so it never reads
    device memory (CUDA-graph safe).
    """
    tuning = _tuning(tuning)
    bh = max(1, batch * num_kv_heads)
    sms = _num_sms(device)
    s = 2.0 * math.sqrt(max_len / bh)
    unit = sms // math.gcd(sms, bh)  # bh·unit programs: a whole number per SM
    if s >= unit / 2:
        s = unit * max(1, round(s / unit))
    wave = programs_per_sm * sms
    if wave < s * bh < 2 * wave and max_len >= 384 * s:
        s = wave // bh
    cap = max(1, max_len // (2 * block_n))
    return int(max(1, min(int(s), cap, tuning.max_splits)))


def gluon_unavailable_reason(cache: PagedKVCache, q: torch.Tensor | None = None) -> str | None:
    """Why the Gluon decode kernel cannot serve ``cache`` (``None``: it can).

    Host-side facts only (dtype, shapes, strides, device capability), so the choice is the
    same on every step and under CUDA-graph capture.
    """
    from ._backend import interpreting

    lo = cache.layout
    if os.environ.get("OSCAR_GLUON_DECODE", "1") == "0":
        return "switched off by OSCAR_GLUON_DECODE=0"
    if interpreting():
        return "the Triton interpreter does not run Gluon kernels"
    dev = cache.device
    if dev.type != "cuda":
        return f"Gluon needs a CUDA device, got {dev}"
    why = _gluon_device_reason(dev.index if dev.index is not None else torch.cuda.current_device())
    if why is not None:
        return why
    if lo.head_dim % 128 != 0:
        return f"head_dim {lo.head_dim} is not a multiple of 128"
    if lo.group != lo.head_dim:
        return f"group_size {lo.group} < head_dim {lo.head_dim} (per-group scales: tl path)"
    if (
        any(st % 4 for st in cache.k_codes.stride()[:3])
        or cache.k_codes.data_ptr() % 4
        or cache.v_codes.data_ptr() % 4
    ):
        return "code pages are not 4-byte aligned (the kernel loads 32-bit code words)"
    if q is not None and triton_next_pow2(q.shape[1] // lo.num_kv_heads) > 64:
        return "GQA group > 64"
    return None


@functools.cache
def _gluon_device_reason(index: int) -> str | None:
    """The device and Triton facts of :func:`gluon_unavailable_reason`, once per device (host cost)."""
    from .kernels.attention_gluon import GLUON_IMPORT_ERROR

    if GLUON_IMPORT_ERROR is not None:
        return f"triton.experimental.gluon is unavailable ({GLUON_IMPORT_ERROR})"
    if torch.version.hip is not None:
        return "the Gluon kernel uses NVIDIA mma_v2 and PTX"
    major, _ = torch.cuda.get_device_capability(index)
    if major < 8:
        return f"Gluon mma_v2 needs sm_80+, got sm_{major}x"
    return None


def resolve_launch(
    cache: PagedKVCache,
    q: torch.Tensor | None,
    impl: str = "auto",
    block_n: int | None = None,
    num_warps: int | None = None,
    programs_per_sm: int | None = None,
) -> tuple[str, int, int, int]:
    """The kernel (``gluon`` / ``tl``) and launch options a decode call will use."""
    check(impl in DECODE_IMPLS, "impl", f"one of {DECODE_IMPLS}", impl)
    if impl != "tl":
        why = gluon_unavailable_reason(cache, q)
        if impl == "gluon" and why is not None:
            raise KernelUnavailableError(f"Invalid impl: impl='gluon' cannot run here: {why}; use impl='tl'")
        impl = "tl" if why is not None else "gluon"
    dflt = _DEFAULTS[impl]
    return (
        impl,
        dflt[0] if block_n is None else block_n,
        dflt[1] if num_warps is None else num_warps,
        dflt[2] if programs_per_sm is None else programs_per_sm,
    )


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def decode_attention(
    q: torch.Tensor,
    cache: PagedKVCache,
    params: LayerQuantParams | ExpandedParams,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
    backend: Backend | str = "auto",
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    programs_per_sm: int | None = None,
    impl: str = "auto",
    check_bounds: bool | None = None,
    tuning: DecodeTuning | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of attention for ``B`` sequences of different lengths.

    Args:
        q: ``[B, H_q, d]`` un-rotated queries (after RoPE); ``H_q = g * H_kv``.
        cache: the layer's cache; must already hold each sequence's ``seq_lens[b]``
            tokens (write the new token first).
        params: rotations / mean / clips (pass :class:`ExpandedParams` per step).
        block_table: ``[B, max_pages]`` int32 page ids of each sequence.
        seq_lens: ``[B]`` int32 cached lengths (0 allowed: output 0).
        window_slots: ``[B]`` int32 rows of the window pools.
        softmax_scale: default ``1/sqrt(d)``.
        num_splits: INT2 splits per (sequence, KV head); default
            :func:`choose_num_splits` (host-only arithmetic).
        backend: ``auto`` | ``triton`` | ``torch``.
        block_n, num_warps, num_stages, programs_per_sm: tile size, launch options and
            resident programs per SM that :func:`choose_num_splits` fills (``None``: the kernel's default,
            see ``_DEFAULTS``; for the Gluon kernel ``num_stages >= 2`` means the next tile's
            loads are issued before the current tile is computed, 1 that they are not).
        impl: ``auto`` (Gluon where :func:`gluon_unavailable_reason` is ``None``, else
            ``tl``), ``gluon`` (error where it cannot run) or ``tl``. Same results up to
            float rounding.
        check_bounds: check page ids and window rows against the cache (one host
            synchronisation; ``None`` = :func:`oscar_kernels.set_bounds_checks`'s setting, off
            while a CUDA graph is captured). An engine checks once per step, not per layer.
        tuning: the launch rules (:class:`DecodeTuning`; ``None``: :data:`DEFAULT_TUNING`).
        out: where to write the result (contiguous ``[B, H_q, d]`` in ``q.dtype``; an engine's
            output buffer saves an allocation and a copy per layer); ``None``: a new tensor.
    Returns:
        ``[B, H_q, d]`` in ``q.dtype`` (``out`` when given).
    """
    check_queries("q", q, cache, 3)
    bsz = q.shape[0]
    check_index_tensor("seq_lens", seq_lens, (bsz,), cache.device)
    check_index_tensor("window_slots", window_slots, (bsz,), cache.device)
    check_index_tensor(
        "block_table",
        block_table,
        (bsz, block_table.shape[-1] if block_table.dim() == 2 else -1),
        cache.device,
    )
    check_decode_bounds(cache, block_table, seq_lens, window_slots, check_bounds)  # off under graph capture
    if out is not None:
        check(
            tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype and out.is_contiguous(),
            "out",
            f"a contiguous {tuple(q.shape)} {q.dtype} tensor",
            f"{tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}",
        )
    plan = plan_decode(
        cache,
        q.shape[1],
        bsz,
        block_table.shape[1],
        softmax_scale,
        backend=backend,
        num_splits=num_splits,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        programs_per_sm=programs_per_sm,
        impl=impl,
        tuning=tuning,
    )
    ep = as_expanded(params, cache.layout.num_kv_heads, cache.layout.head_dim, cache.device)
    return run_decode(plan, q, cache, ep, block_table, seq_lens, window_slots, out)


class DecodePlan(NamedTuple):
    """Everything a decode launch needs that depends on sizes only (:func:`plan_decode`): built
    once per engine step and reused by every layer of the same layout (:func:`run_decode`)."""

    use_triton: bool
    impl: str
    split: SplitLaunch
    scale: float
    gqa: int
    tuning: DecodeTuning
    pdl: bool = False  # the kernels launch as programmatic dependents (pdl_available, once)


def plan_decode(
    cache: PagedKVCache,
    num_q_heads: int,
    batch: int,
    max_pages: int,
    softmax_scale: float | None = None,
    backend: Backend | str = "auto",
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    programs_per_sm: int | None = None,
    impl: str = "auto",
    tuning: DecodeTuning | None = None,
) -> DecodePlan:
    """The launch of :func:`decode_attention` for ``batch`` sequences of ``num_q_heads`` query heads
    over block tables ``max_pages`` wide: kernel, tiles, warps, split count (host arithmetic on
    sizes only: the same on every step of that shape and under CUDA-graph capture). Arguments as
    :func:`decode_attention`'s."""
    lo = cache.layout
    check(impl in DECODE_IMPLS, "impl", f"one of {DECODE_IMPLS}", impl)
    check(
        num_q_heads % lo.num_kv_heads == 0 and num_q_heads > 0,
        "num_q_heads",
        f"a positive multiple of num_kv_heads={lo.num_kv_heads}",
        num_q_heads,
    )
    g = num_q_heads // lo.num_kv_heads
    tuning = _tuning(tuning)
    scale = 1.0 / math.sqrt(lo.head_dim) if softmax_scale is None else float(softmax_scale)
    if not use_triton(cache.device, backend):
        return DecodePlan(False, "torch", SplitLaunch(1, 1, 1, 1), scale, g, tuning)
    if impl != "tl" and triton_next_pow2(g) > 64:
        if impl == "gluon":
            raise KernelUnavailableError(
                "Invalid impl: impl='gluon' cannot run here: GQA group > 64; use impl='tl'"
            )
        impl = "tl"
    free_block_n = block_n is None
    impl, block_n, num_warps, programs_per_sm = resolve_launch(
        cache, None, impl, block_n, num_warps, programs_per_sm
    )
    max_len = max_pages * lo.page_size
    if impl == "gluon" and free_block_n and num_splits is None:
        block_n = gluon_block_n(batch, lo, max_len, cache.device, programs_per_sm, tuning)
    if num_splits is None:
        num_splits = choose_num_splits(
            batch, lo.num_kv_heads, max_len, cache.device, block_n, programs_per_sm, tuning
        )
    split = SplitLaunch(num_splits, block_n, num_warps, num_stages)
    return DecodePlan(True, impl, split, scale, g, tuning, pdl_available(cache.device, tuning))


def run_decode(
    plan: DecodePlan,
    q: torch.Tensor,
    cache: PagedKVCache,
    params: ExpandedParams,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window_slots: torch.Tensor,
    out: torch.Tensor | None = None,
    after_window_pass: bool = False,
) -> torch.Tensor:
    """One layer's decode attention as ``plan`` says, without :func:`decode_attention`'s checks
    (the caller checked the step's tensors once): launches only. ``after_window_pass``: the
    kernel before it on this stream is the step's window pass (``paged_write(parts="window")``):
    where PDL is available the query rotation runs beside that pass (``rotate_rows_kernel``'s
    ``WAIT_END``)."""
    if not plan.use_triton:
        res = decode_attention_ref(q, cache, params, block_table, seq_lens, window_slots, plan.scale)
        return res if out is None else out.copy_(res)
    early = after_window_pass and plan.pdl
    q_rot, rope = _rotate_queries_triton(q, params, plan.tuning, plan.pdl, early)
    return _launch_decode(
        q_rot,
        cache,
        block_table,
        seq_lens,
        window_slots,
        plan.scale,
        plan.gqa,
        plan.split,
        impl=plan.impl,
        unrotate=None if params.rotated_output else params.v_rotation,
        out_dtype=q.dtype,
        rope=rope,
        tuning=plan.tuning,
        out=out,
        pdl=plan.pdl,
    )


def rope_slots(pairs: int) -> int:
    """Pair slots (``P``) a kernel reads for ``R`` pairs of the score term: at least 8, since
    every split and extend kernel packs cosines and sines into one ``K = 2·P`` operand (the ``tl``
    kernels' bf16 ``tl.dot`` needs ``K >= 16``, the Gluon decode's tf32 ``mma`` takes steps of 8).
    Padding slots have zero coefficients."""
    return max(8, pairs)


def _rotate_queries_triton(
    q: torch.Tensor,
    ep: ExpandedParams,
    tuning: DecodeTuning | None = None,
    pdl: bool | None = None,
    early: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, int, int] | None]:
    """:func:`rotate_queries` in one Triton launch (bf16 out, float32 products), and with a
    pre-RoPE mean (``ep.rope_pairs > 0``) the score coefficients from the same launch:
    ``(q_rot, (C [B, H_q, 2, P], θ [R], R, P))`` (``P`` = :func:`rope_slots`), else
    ``(q_rot, None)``. ``early``: launched as a programmatic dependent of the window pass before it
    (:func:`run_decode`'s ``after_window_pass``; PDL only)."""
    tuning = _tuning(tuning)
    from .kernels.attention import rotate_rows_kernel

    bsz, hq, d = q.shape
    if q.stride(2) != 1:
        q = q.contiguous()
    rot = ep.k_rotation  # q @ R_K: out[i] = Σ_j q[j]·R[j, i]
    out = _empty(bsz, hq, d, dtype=torch.bfloat16, device=q.device)
    rows = tuning.rotate_rows_per_program
    if rows and tuning.rotate_rows_small and bsz * hq * d // rows < _num_sms(q.device):
        rows = tuning.rotate_rows_small
    rows = rows if rows and d % rows == 0 else 0
    nr = ep.rope_pairs
    rope, extra = None, {}
    if nr > 0:
        npad = rope_slots(nr)
        rc = _empty(bsz, hq, 2, npad, dtype=torch.float32, device=q.device)
        ab, pairs = ep.k_rope_ab.contiguous(), ep.k_rope_pairs.contiguous()
        extra = dict(rc_ptr=rc, ab_ptr=ab, pairs_ptr=pairs, ROPE_R=nr, ROPE_P=npad)
        rope = (rc, ep.k_rope_theta.contiguous(), nr, npad)
    launch(rotate_rows_kernel, (bsz * hq, d // rows if rows else 1),
        q, q.stride(0), q.stride(1), rot, rot.stride(0), rot.stride(2), rot.stride(1), out, hq,
        hq // rot.shape[0], HEAD_DIM=d, RC=min(32, d),
        PDL=pdl_available(q.device, tuning) if pdl is None else pdl, ROWS=rows,
        **extra, **({"WAIT_END": True, "launch_pdl": True} if early else {}),
    )  # fmt: skip
    return out, rope


class SplitLaunch(NamedTuple):
    """How the split kernel of one decode call launches (:func:`resolve_launch`,
    :func:`choose_num_splits`)."""

    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int


def _launch_decode(
    q_rot,
    cache,
    block_table,
    seq_lens,
    window_slots,
    scale,
    g,
    split: SplitLaunch,
    impl="tl",
    unrotate=None,
    out_dtype=torch.float32,
    rope=None,
    tuning: DecodeTuning | None = None,
    out=None,
    pdl: bool | None = None,
):
    """Split kernel + merge (launched as ``split`` says); ``pdl``: as a programmatic dependent
    (``None``: :func:`pdl_available`); ``unrotate`` (``[H_kv, d, d]`` ``R_V``):
    the merge also returns ``o @ R_Vᵀ`` in ``out_dtype`` (else the rotated float32 output).
    ``rope``: the pre-RoPE mean's ``(C, θ, R, P)`` (:func:`_rotate_queries_triton`; ``None``: no
    score term)."""
    tuning = _tuning(tuning)
    import triton

    from ._backend import interpreting
    from .kernels.attention import decode_split_kernel

    num_splits, block_n, num_warps, num_stages = split

    lo = cache.layout
    bsz, hq, d = q_rot.shape
    pdl = pdl_available(q_rot.device, tuning) if pdl is None else pdl
    if impl == "gluon":
        from .kernels.attention_gluon import WINDOW_TOKENS_PER_PROGRAM, window_programs

        w_tok = tuning.window_tokens or WINDOW_TOKENS_PER_PROGRAM
        nt = num_splits + window_programs(lo.sink_tokens, lo.recent_tokens, w_tok)
    else:
        nt = num_splits + 2
    po = _empty(bsz, hq, nt, d, dtype=torch.float32, device=q_rot.device)
    plse = _empty(bsz, hq, nt, dtype=torch.float32, device=q_rot.device)
    kc, vc = cache.k_codes, cache.v_codes
    grid = (bsz * lo.num_kv_heads, nt)
    common = (
        q_rot,
        q_rot.stride(0),
        q_rot.stride(1),
        *cache.kernel_operands((kc, vc)),
        block_table,
        block_table.stride(0),
        seq_lens,
        window_slots,
        po,
        plse,
        scale * math.log2(math.e),
        lo.page_size,
    )
    # the score term's operands only where it is on: R = 0 compiles today's kernels unchanged
    rope_args = {} if rope is None else dict(rc_ptr=rope[0], rth_ptr=rope[1], ROPE_R=rope[2], ROPE_P=rope[3])
    if impl == "gluon":
        from .kernels.attention_gluon import decode_split_kernel_gluon

        # every tile inside one page: tiles start at sink + k·block_n
        one_page = lo.page_size % block_n == 0 and lo.sink_tokens % block_n == 0
        ring, wide = 0, False
        if one_page and num_stages >= 2:  # the ring copies one-page tiles
            max_len = block_table.shape[1] * lo.page_size
            ring, wide = async_ring_mode(
                max_len, lo.sink_tokens, lo.recent_tokens, num_splits, block_n,
                bsz * lo.num_kv_heads * num_splits, _num_sms(q_rot.device), tuning,
            )  # fmt: skip
        if rope is not None:  # angle addition where its loop-invariant operand is small
            add = (
                block_n >= tuning.rope_addition_min_block_n
                and block_n * 2 * rope[3] <= tuning.rope_addition_max_elements
            )
            rope_args["ROPE_MODE"] = 2 if add else 1
        LAST_COMPILED["decode_split"] = launch(
            decode_split_kernel_gluon,
            grid,
            *common,
            num_splits,
            H_KV=lo.num_kv_heads,
            GQA=g,
            NP=max(8, triton.next_power_of_2(g)),
            HEAD_DIM=d,
            SINK=lo.sink_tokens,
            RECENT=lo.recent_tokens,
            RING=max(1, lo.recent_tokens),
            BLOCK_N=block_n,
            BLOCK_W=32,  # window tiles: 64 would raise the register count of every program
            W_TOK=w_tok,
            PREFETCH=num_stages >= 2,  # register double buffering of the next tile
            ONE_PAGE=one_page,
            PDL=pdl,
            ASYNC=ring,
            ASYNC_WIDE=wide,
            num_warps=num_warps,
            **rope_args,
            **({"launch_pdl": True} if pdl else {}),
        )
    else:
        opts = {} if interpreting() else {"num_warps": num_warps, "num_stages": num_stages}
        LAST_COMPILED["decode_split"] = launch(
            decode_split_kernel,
            grid,
            *common,
            H_KV=lo.num_kv_heads,
            GQA=g,
            G_PAD=max(16, triton.next_power_of_2(g)),  # tl.dot needs 16 rows
            HEAD_DIM=d,
            GROUP=lo.group,
            SINK=lo.sink_tokens,
            RECENT=lo.recent_tokens,
            RING=max(1, lo.recent_tokens),
            NUM_SPLITS=num_splits,
            BLOCK_N=block_n,
            BLOCK_W=64,
            DOT=dot_dtype(),
            UNPACK=unpack_mode(),
            **rope_args,
            **opts,
        )
    return merge_partials(po, plse, g, unrotate, out_dtype, out, pdl, tuning)


def merge_partials(
    po: torch.Tensor,
    plse: torch.Tensor,
    gqa: int,
    unrotate: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    tuning: DecodeTuning | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """LSE-merge of a split kernel's partials ``po [B, H_q, NT, d]`` / ``plse [B, H_q, NT]`` in
    ``out_dtype``; with ``unrotate`` (``[H_kv, d, d]``) also ``o @ R_Vᵀ``. ``pdl``:
    launched as a programmatic dependent of the split kernel. ``chunk``: partials per step (a
    power of two; default: v2 ``tuning.merge_chunk``, v1 ``NT``'s, at most 64).

    ``tuning.merge_impl`` ``"v2"`` (issue #38): ``merge_cols_kernel`` on ``(B·H_q, d / block_d)``
    programs (into float32 scratch where an un-rotation follows), then ``unrotate_rows_kernel``
    on ``(H_kv, d / cols, ⌈B·GQA / rows⌉)`` programs (a programmatic dependent of the merge where
    PDL is available): both kernels' grids fill the SMs at batch 1 and ``R_V`` is read per KV
    head and row block, not per query row. ``"v1"``: ``merge_splits_kernel``, one program per
    query row (merge and un-rotation in one launch). Without ``unrotate`` (the engine folded
    ``R_V`` into its output projection) always ``merge_cols_kernel`` alone: ``merge_impl`` picks
    between two ways of un-rotating."""
    tuning = _tuning(tuning)
    check(tuning.merge_impl in ("v1", "v2"), "merge_impl", "'v1' or 'v2'", tuning.merge_impl)
    if tuning.merge_impl == "v1" and unrotate is not None:
        return _merge_partials_v1(po, plse, gqa, unrotate, out_dtype, out, pdl, tuning, chunk)
    from ._backend import interpreting
    from .kernels.attention import merge_cols_kernel, unrotate_rows_kernel

    bsz, hq, nt, d = po.shape
    rows = bsz * hq
    bd, oc, bm = min(tuning.merge_block_d, d), min(tuning.merge_rotate_cols, d), tuning.merge_rotate_rows
    check(d % bd == 0 and d % oc == 0, "merge head dim", f"a multiple of {bd} and {oc}", d)
    if out is None:
        out = _empty(bsz, hq, d, dtype=out_dtype, device=po.device)
    opts = {} if interpreting() else {"num_warps": tuning.merge_num_warps}
    # the un-rotation chained by PDL where the device has it (also where the merge itself is not a
    # dependent of a split kernel: extend)
    chain = unrotate is not None and pdl_available(po.device, tuning)
    merged = out if unrotate is None else _empty(bsz, hq, d, dtype=torch.float32, device=po.device)
    launch(merge_cols_kernel, (rows, d // bd),
        po, plse, merged, nt, HEAD_DIM=d, DC=bd, CH=chunk or tuning.merge_chunk, PDL=pdl, DEPENDENTS=chain,
        **({"launch_pdl": True} if pdl else {}), **opts,
    )  # fmt: skip
    if unrotate is not None:
        hkv = hq // gqa
        rot = unrotate
        launch(unrotate_rows_kernel, (hkv, d // oc, _cdiv(bsz * gqa, bm)),
            merged, rot, rot.stride(0), rot.stride(1), rot.stride(2), out, bsz * gqa, hq, gqa,
            HEAD_DIM=d, BM=bm, OC=oc, KC=min(32, d), PDL=chain,
            **({"launch_pdl": True} if chain else {}), **opts,
        )  # fmt: skip
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _merge_partials_v1(po, plse, gqa, unrotate, out_dtype, out, pdl, tuning, chunk) -> torch.Tensor:
    """:func:`merge_partials` with ``merge_impl="v1"`` (``merge_splits_kernel``), un-rotating
    (``merge_partials`` sends merges without ``unrotate`` to ``merge_cols_kernel``): the A/B baseline."""
    from ._backend import interpreting
    from .kernels.attention import merge_splits_kernel

    bsz, hq, nt, d = po.shape
    rot = unrotate
    rs = (rot.stride(0), rot.stride(1), rot.stride(2))
    if out is None:
        out = _empty(bsz, hq, d, dtype=out_dtype, device=po.device)
    preload = d <= tuning.merge_preload_max_d
    mopts = {"num_warps": 8} if preload and not interpreting() else {}  # [d, d] in registers
    launch(merge_splits_kernel, (bsz * hq,),
        po, plse, out, rot, *rs, nt, hq, gqa, HEAD_DIM=d, CH=chunk or min(64, triton_next_pow2(nt)),
        ROTATE=True, RC=min(32, d), PDL=pdl, PRELOAD=preload,
        **({"launch_pdl": True} if pdl else {}), **mopts,
    )  # fmt: skip
    return out
