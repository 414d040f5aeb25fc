"""Triton body of :func:`oscar_kernels.rotate` on CUDA: per KV head, a tile of rows times that
head's rotation at float32 accuracy, rounded to the output dtype.

Products are 3×TF32 (``tl.dot(..., input_precision="tf32x3")``: each operand split into a TF32
high part and a TF32 remainder, three tensor-core products summed in float32), ~1e-6 relative
like float32's own rounding. Measured on the H200 for 8192 tokens × 8 KV heads × 4 rows × 128
(bf16 out): 0.146 ms, against 13.5 ms for IEEE float32 ``tl.dot`` (FMA loops) and 2.8 ms for the
per-head ``torch.bmm`` it replaces, which is also not batch-invariant on CUDA (cuBLAS picks its
algorithm by batch count).

Tile sizes are fixed, never chosen from the row count: a row's products then run the same
instructions in the same order whatever else is in the call, so a token's rotation is bitwise
the same in any batch or chunk (prefix-cache hits must reproduce the miss).
"""

import triton
import triton.language as tl

from .attention import _round_store_masked


@triton.jit(do_not_specialize=["ROWS"])  # a bound only: one compile for every token count
def rotate_tiles_kernel(
    x_ptr, sx_n, sx_h, sx_g,
    rot_ptr, sr_h, sr_i, sr_j,
    mean_ptr, sm_h,
    out_ptr, ROWS, G,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MEAN: tl.constexpr,
):  # fmt: skip
    """Program ``(m, h)``: rows ``r = m·BLOCK_M + [0, BLOCK_M)`` of head ``h`` (row ``r`` is
    token ``r // G``, group member ``r % G`` of ``x [N, H, G, D]``, any strides with a unit last
    one), minus ``mean[h]`` when ``HAS_MEAN``, times ``rot[h] [D, D]`` (``out = x @ rot``, any
    strides: a transposed view gives ``x @ rotᵀ``) into the contiguous ``out [N, H, G, D]``."""
    h = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = r < ROWS
    tok = (r // G).to(tl.int64)
    g = r % G
    k = tl.arange(0, D)
    x = tl.load(
        x_ptr + tok[:, None] * sx_n + h * sx_h + g[:, None] * sx_g + k[None, :], mask=live[:, None], other=0.0
    ).to(tl.float32)
    if HAS_MEAN:
        x = x - tl.load(mean_ptr + h * sm_h + k)[None, :]
    out_row = ((tok * H + h) * G + g) * D
    for n0 in tl.static_range(0, D, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        w = tl.load(rot_ptr + h * sr_h + k[:, None] * sr_i + n[None, :] * sr_j)
        y = tl.dot(x, w, input_precision="tf32x3")
        _round_store_masked(out_ptr + out_row[:, None] + n[None, :], y, live[:, None])


# the row count and the log-sum-exps' head strides (the step's token count) vary by step: one
# compile for all of them, none while serving
@triton.jit(do_not_specialize=["ROWS", "sl1_h", "sl2_h"])
def merge_unrotate_kernel(
    o1_ptr, s1_n, s1_h, l1_ptr, sl1_h, sl1_n,
    o2_ptr, s2_n, s2_h, l2_ptr, sl2_h, sl2_n,
    rot_ptr, sr_h, sr_i, sr_j,
    out_ptr, ROWS, G,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    TWO: tl.constexpr, ROTATE: tl.constexpr = True,
):  # fmt: skip
    """Program ``(m, h)``: rows ``r = m·BLOCK_M + [0, BLOCK_M)`` of KV head ``h`` (row ``r`` is
    token ``r // G``, query head ``h·G + r % G``). Joins two partial attentions over disjoint key
    sets, ``o1/o2 [N, H·G, D]`` with log-sum-exps ``l1/l2 [H·G, N]`` (natural log; a set without
    keys for a row has an infinite or NaN ``l`` and is dropped), in float32, then multiplies the
    row by ``rot[h]`` as :func:`rotate_tiles_kernel` does (same tiles, 3×TF32) into the contiguous
    ``out [N, H·G, D]``. ``TWO = False``: one set only (``o2``/``l2`` are not read).
    ``ROTATE = False``: the merged rows as they are (the engine folded ``R_V`` into its output
    projection; ``rot`` is not read)."""
    h = tl.program_id(1)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = r < ROWS
    tok = (r // G).to(tl.int64)
    hq = h * G + r % G
    k = tl.arange(0, D)
    a1 = tl.load(l1_ptr + hq * sl1_h + tok * sl1_n, mask=live, other=float("inf"))
    ok1 = tl.abs(a1) < float("inf")  # FlashAttention's +inf, others' -inf, NaN: no keys
    m1 = tl.where(ok1, a1, float("-inf"))
    x = tl.load(o1_ptr + tok[:, None] * s1_n + hq[:, None] * s1_h + k[None, :], mask=live[:, None], other=0.0)
    x = tl.where(ok1[:, None], x.to(tl.float32), 0.0)
    if TWO:
        a2 = tl.load(l2_ptr + hq * sl2_h + tok * sl2_n, mask=live, other=float("inf"))
        ok2 = tl.abs(a2) < float("inf")
        m2 = tl.where(ok2, a2, float("-inf"))
        mx = tl.maximum(m1, m2)
        mx = tl.where(mx > float("-inf"), mx, 0.0)  # both sets empty: weights 0, output 0
        w1 = tl.exp(m1 - mx)
        w2 = tl.exp(m2 - mx)
        y = tl.load(
            o2_ptr + tok[:, None] * s2_n + hq[:, None] * s2_h + k[None, :], mask=live[:, None], other=0.0
        )
        y = tl.where(ok2[:, None], y.to(tl.float32), 0.0)
        x = (x * w1[:, None] + y * w2[:, None]) / tl.maximum(w1 + w2, 1e-30)[:, None]
    else:
        w1 = tl.exp(m1 - tl.where(ok1, m1, 0.0))  # 1 with keys, 0 without
        x = x * w1[:, None] / tl.maximum(w1, 1e-30)[:, None]
    out_row = (tok * (H * G) + hq) * D
    if ROTATE:
        for n0 in tl.static_range(0, D, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            w = tl.load(rot_ptr + h * sr_h + n[None, :] * sr_j + k[:, None] * sr_i)
            z = tl.dot(x, w, input_precision="tf32x3")
            _round_store_masked(out_ptr + out_row[:, None] + n[None, :], z, live[:, None])
    else:
        _round_store_masked(out_ptr + out_row[:, None] + k[None, :], x, live[:, None])
