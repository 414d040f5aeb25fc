"""Public fused write op: rotate, clip, quantise, pack and store tokens into the cache."""

from __future__ import annotations

import torch

from oscar_math import check

from ._backend import Backend, interpreting, use_triton
from ._validate import check_write_bounds
from .launch import launch
from .layout import PagedKVCache
from .params import ExpandedParams, LayerQuantParams, as_expanded
from .reference.paged_write import paged_write_ref

#: the last compiled kernel (diagnostics for benchmarks)
LAST_COMPILED: dict = {}

__all__ = ["paged_write", "WRITE_PARTS"]

#: what one :func:`paged_write` call stores: everything, the INT2 pages + sink rows, or the ring rows
WRITE_PARTS = ("all", "pages", "ring")


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
) -> None:
    """Quantise ``N`` new tokens into ``cache`` in place (one fused kernel for K, one for V).

    Every token goes to its INT2 slot; a token also goes to its sequence's BF16 sink
    row when ``position < sink`` and to its ring row ``position % recent`` when
    ``position >= max(sink, seq_len - recent)``.

    ``parts`` splits the write around a prefill chunk's attention (``docs/kernels.md``,
    "Order of writes"): ``"pages"`` stores the INT2 rows and the sink rows only,
    ``"ring"`` the ring rows only, ``"all"`` both. A decode step (one token per sequence)
    writes ``"all"`` before attention. A chunk writes ``"pages"`` before
    :func:`oscar_kernels.extend_attention` (which reads the chunk's INT2 rows and sink rows)
    and ``"ring"`` after it: the chunk's ring rows overwrite the rows of positions
    ``p - recent`` that the chunk's first queries still read in BF16.

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
        parts: ``"all"`` | ``"pages"`` | ``"ring"`` (see above).
    """
    lo = cache.layout
    check(parts in WRITE_PARTS, "parts", f"one of {WRITE_PARTS}", parts)
    _validate(cache, key, value, slot_mapping, positions, seq_index, seq_lens, window_slots)
    check_write_bounds(cache, slot_mapping, positions, seq_index, seq_lens, window_slots, check_bounds)
    ep = as_expanded(params, lo.num_kv_heads, lo.head_dim, cache.device)
    if key.shape[0] == 0 or (parts == "ring" and lo.recent_tokens == 0):
        return
    if not use_triton(cache.device, backend):
        paged_write_ref(
            cache, ep, key, value, slot_mapping, positions, seq_index, seq_lens, window_slots, parts
        )
        return
    import triton

    from .kernels.paged_write import paged_write_kernel

    n = key.shape[0]
    default_bt = 128 if lo.head_dim <= 128 else 32
    prec = "ieee" if (precise or interpreting()) else "tf32"
    rope = ep.k_rope_mean is not None
    for x, rot, fb, codes, scale, zero, sink, ring, alpha, has_mean, has_rope in (
        (
            key,
            ep.k_rotation,
            ep.k_feedback,
            cache.k_codes,
            cache.k_scale,
            cache.k_zero,
            cache.k_sink,
            cache.k_recent,
            ep.k_clip,
            ep.has_mean,
            rope,
        ),
        (
            value,
            ep.v_rotation,
            ep.v_feedback,
            cache.v_codes,
            cache.v_scale,
            cache.v_zero,
            cache.v_sink,
            cache.v_recent,
            ep.v_clip,
            False,
            False,
        ),
    ):
        # the feedback loop runs faster on smaller token blocks (register pressure; see docstring);
        # the in-kernel RoPE_p(m) of a plain key tensor spills least at 64 tokens on 8 warps
        # (ptxas for sm_90: 160 B against 2144 B at 128 tokens on 4)
        rope_plain = has_rope and fb is None
        bt = (
            block_t if block_t is not None else (32 if fb is not None else (64 if rope_plain else default_bt))
        )
        if block_t is None:
            # a decode step writes one token per sequence: a 128-token tile per KV head rotated
            # 128 rows for each real one (H200, Qwen3-8B shape, batch 1: 20 us per launch, 40% of
            # OSCAR's device time in a 2k decode step); tiles of the next power of two >= n
            # (>= 16 for tl.dot), compiled for every CUDA-graph capture size at capture
            bt = min(bt, max(16, triton.next_power_of_2(n)))
        warps = num_warps if num_warps is not None else (8 if rope_plain else 4)
        kwargs = {} if interpreting() else {"enable_fp_fusion": False, "num_warps": warps}
        grid = (triton.cdiv(n, bt), lo.num_kv_heads)
        LAST_COMPILED["paged_write"] = launch(
            paged_write_kernel,
            grid,
            x,
            x.stride(0),
            x.stride(1),
            rot,
            rot.stride(0),
            rot.stride(1),
            ep.k_mean,
            ep.k_mean.stride(0),
            # pre-RoPE mean and inverse frequencies: valid pointers either way, read only with HAS_ROPE
            ep.k_rope_mean if has_rope else ep.k_mean,
            ep.k_rope_mean.stride(0) if has_rope else 0,
            ep.k_rope_inv_freq if has_rope else ep.k_mean,
            alpha,
            rot if fb is None else fb,  # a valid pointer either way; read only with HAS_FEEDBACK
            0 if fb is None else fb.stride(0),
            0 if fb is None else fb.stride(1),
            slot_mapping,
            positions,
            seq_index,
            seq_lens,
            window_slots,
            codes,
            codes.stride(0),
            codes.stride(1),
            codes.stride(2),
            scale,
            zero,
            scale.stride(0),
            scale.stride(1),
            scale.stride(2),
            sink,
            sink.stride(0),
            sink.stride(1),
            sink.stride(2),
            ring,
            ring.stride(0),
            ring.stride(1),
            ring.stride(2),
            n,
            lo.page_size,
            HEAD_DIM=lo.head_dim,
            GROUP=lo.group,
            SINK=lo.sink_tokens,
            RECENT=lo.recent_tokens,
            HAS_MEAN=has_mean,
            HAS_FEEDBACK=fb is not None,
            HAS_ROPE=has_rope,
            WRITE_PAGES=parts != "ring",
            WRITE_RING=parts != "pages",
            BLOCK_T=bt,
            DOT_PRECISION=prec,
            **kwargs,
        )
