"""Public decode attention op: split-K flash-decoding over INT2 pages + BF16 windows."""

from __future__ import annotations

import math

import torch

from oscar_math import check

from ._backend import Backend, dot_dtype, unpack_mode, use_triton
from ._validate import check_decode_bounds, check_index_tensor, check_queries
from .layout import PagedKVCache
from .params import ExpandedParams, LayerQuantParams, as_expanded
from .reference.attention import decode_attention_ref
from .rotate import rotate_queries, unrotate_output


def _empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Scratch/output allocation (a hook: the GPU check script poisons it with NaN)."""
    return torch.empty(*shape, dtype=dtype, device=device)


#: the last compiled kernels (diagnostics for benchmarks: registers, spills, PTX)
LAST_COMPILED: dict = {}

__all__ = ["decode_attention", "choose_num_splits", "paged_bf16_decode", "DECODE_IMPLS"]

#: INT2 tile loops of the decode kernel: ``dot`` (tensor cores via ``tl.dot``, GQA group
#: padded to 16 rows), ``fma`` (CUDA-core float32 FMA, group padded to a power of two),
#: ``fma-kt`` (``fma`` with the key products laid out ``[heads, d/4, tokens]``), ``fma-t``
#: (``fma-kt`` plus the value products laid out ``[tokens, heads, d/4]``)
DECODE_IMPLS = ("dot", "fma", "fma-kt", "fma-t")

#: launch defaults per implementation: (block_n, num_warps)
_DEFAULTS = {"dot": (128, 4), "fma": (64, 4), "fma-kt": (64, 8), "fma-t": (32, 4)}


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_len: int,
    device: torch.device,
    block_n: int = 64,
    programs_per_sm: int = 4,
) -> int:
    """Splits of the INT2 range per (sequence, KV head), from host-known sizes only.

    Enough programs to put ``programs_per_sm`` on every SM, but no split shorter than two tiles.
    Depends on ``max_len`` (``block_table.shape[1] * page_size``), not on the actual
    lengths, so it never reads device memory (CUDA-graph safe).
    """
    want = max(1, -(-programs_per_sm * _num_sms(device) // max(1, batch * num_kv_heads)))
    cap = max(1, max_len // (2 * block_n))
    return int(min(want, cap, 256))


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
    unpack: str = "asm",
    programs_per_sm: int = 8,
    impl: str = "dot",
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
        block_n, num_warps, num_stages: Triton tile size and launch options (``None``:
            the default of ``impl``: see ``_DEFAULTS``).
        programs_per_sm: split-count target of :func:`choose_num_splits`.
        unpack: how INT2 codes become operands: ``asm`` (PTX ``prmt``), ``int16`` or
            ``convert``; with ``impl="fma"`` ``asm``/``int16`` mean the exponent trick
            (``1 + code/4`` in integer ops) and ``convert`` an int→float conversion.
        impl: INT2 tile loop, one of :data:`DECODE_IMPLS`: ``dot`` (``tl.dot``),
            ``fma`` (CUDA-core FMA, dequantisation folded per token), ``fma-kt``
            (the same with the key sum inside each thread) or ``fma-t`` (key and
            value sums inside threads). Same results up to float rounding; the BF16
            windows follow the same choice (in the ``fma`` layout).
    Returns:
        ``[B, H_q, d]`` in ``q.dtype``.
    """
    lo = cache.layout
    g = check_queries("q", q, cache, 3)
    bsz = q.shape[0]
    check_index_tensor("seq_lens", seq_lens, (bsz,), cache.device)
    check_index_tensor("window_slots", window_slots, (bsz,), cache.device)
    check_index_tensor(
        "block_table",
        block_table,
        (bsz, block_table.shape[-1] if block_table.dim() == 2 else -1),
        cache.device,
    )
    check_decode_bounds(cache, block_table, seq_lens, window_slots)  # off under graph capture, see _validate
    check(impl in DECODE_IMPLS, "impl", f"one of {DECODE_IMPLS}", impl)
    unpack_mode(unpack)  # validates the name
    ep = as_expanded(params, lo.num_kv_heads, lo.head_dim, cache.device)
    block_n = _DEFAULTS[impl][0] if block_n is None else block_n
    num_warps = _DEFAULTS[impl][1] if num_warps is None else num_warps
    if not use_triton(cache.device, backend):
        return decode_attention_ref(q, cache, ep, block_table, seq_lens, window_slots, softmax_scale)
    scale = 1.0 / math.sqrt(lo.head_dim) if softmax_scale is None else softmax_scale
    q_rot = rotate_queries(q, ep)
    if num_splits is None:
        num_splits = choose_num_splits(
            bsz, lo.num_kv_heads, block_table.shape[1] * lo.page_size, cache.device, block_n, programs_per_sm
        )
    out = _launch_decode(
        q_rot,
        cache,
        block_table,
        seq_lens,
        window_slots,
        scale,
        g,
        num_splits,
        block_n,
        num_warps,
        num_stages,
        unpack=unpack,
        impl=impl,
    )
    return unrotate_output(out, ep, q.dtype)


def _launch_decode(
    q_rot,
    cache,
    block_table,
    seq_lens,
    window_slots,
    scale,
    g,
    num_splits,
    block_n,
    num_warps,
    num_stages,
    bf16_pages=None,
    unpack="asm",
    impl="dot",
):
    import triton
    import triton.language as tl

    from ._backend import interpreting
    from .kernels.attention import decode_split_kernel, merge_splits_kernel

    lo = cache.layout
    bsz, hq, d = q_rot.shape
    nt = num_splits + 2
    po = _empty(bsz, hq, nt, d, dtype=torch.float32, device=q_rot.device)
    plse = _empty(bsz, hq, nt, dtype=torch.float32, device=q_rot.device)
    kc, vc = (cache.k_codes, cache.v_codes) if bf16_pages is None else bf16_pages
    opts = {} if interpreting() else {"num_warps": num_warps, "num_stages": num_stages}
    fma = impl.startswith("fma")
    # tl.dot needs 16 rows; the FMA loop only a power of two
    g_pad = triton.next_power_of_2(g) if fma else max(16, triton.next_power_of_2(g))
    LAST_COMPILED["decode_split"] = decode_split_kernel[(bsz * lo.num_kv_heads, nt)](
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
        H_KV=lo.num_kv_heads,
        GQA=g,
        G_PAD=g_pad,
        HEAD_DIM=d,
        GROUP=lo.group,
        SINK=lo.sink_tokens if bf16_pages is None else 0,
        RECENT=lo.recent_tokens if bf16_pages is None else 0,
        RING=max(1, lo.recent_tokens),
        NUM_SPLITS=num_splits,
        BLOCK_N=block_n,
        BLOCK_W=64,
        PAGED_BF16=bf16_pages is not None,
        DOT=tl.float32 if fma else dot_dtype(),
        UNPACK=unpack_mode(unpack),
        FMA={"dot": 0, "fma": 1, "fma-kt": 2, "fma-t": 3}[impl],
        FUNPACK=0 if unpack == "convert" else 1,
        **opts,
    )
    out = _empty(bsz, hq, d, dtype=torch.float32, device=q_rot.device)
    merge_splits_kernel[(bsz * hq,)](po, plse, out, NT=nt, NT_PAD=triton.next_power_of_2(nt), HEAD_DIM=d)
    return out


def paged_bf16_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Baseline: the same split-K kernel over plain BF16 pages (no rotation, no windows).

    Args:
        q: ``[B, H_q, d]`` bf16.
        k_pages, v_pages: ``[num_pages, H_kv, page_size, d]`` bf16.
        block_table: ``[B, max_pages]``; seq_lens: ``[B]``.
    Returns:
        ``[B, H_q, d]`` float32.
    """
    from .layout import CacheLayout, allocate_cache

    n_pages, h, ps, d = k_pages.shape
    lo = CacheLayout(h, d, page_size=ps, sink_tokens=0, recent_tokens=0)
    shell = allocate_cache(lo, 1, 1, k_pages.device)  # scale/window tensors are not read
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    bsz = q.shape[0]
    if num_splits is None:
        num_splits = choose_num_splits(bsz, h, block_table.shape[1] * ps, q.device, block_n)
    return _launch_decode(
        q,
        shell,
        block_table,
        seq_lens,
        torch.zeros_like(seq_lens),
        scale,
        q.shape[1] // h,
        num_splits,
        block_n,
        num_warps,
        num_stages,
        bf16_pages=(k_pages, v_pages),
    )
