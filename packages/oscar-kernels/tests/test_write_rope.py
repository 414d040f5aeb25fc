"""The write with a pre-RoPE key mean (artifact format version 3, ``oscar_math.rope_center``).

The INT2 key row of position ``p`` quantises ``(k − k_mean − RoPE_p(m)) @ R_K``; the BF16
sink/ring rows stay ``(k − k_mean) @ R_K``. The Triton kernel computes ``RoPE_p(m)`` in
float32 (one float32 angle ``p·θ``); the torch reference in float64
(``rope_position_mean``). So:

* with all ``θ = 0`` the offset is the mean itself on both sides: with an exact rotation the
  whole cache must be bit-identical, decode steps, chunks and feedback included;
* with real frequencies the offsets differ by float32 rounding only: the BF16 rows and the
  values stay bit-exact, the key codes/scales at most rarely one step apart;
* the kernel's offset itself, read back through the scale/zero of keys equal to the
  float64 ``RoPE_p(m)`` (an identity rotation, no clip: the reference stores zeros), is
  within the float32 angle's rounding at positions up to 10^5;
* written keys that carry a rotating mean (``k_p = RoPE_p(m) + noise``) dequantise, plus
  ``RoPE_p(m)``, to the key within the INT2 error of the noise, far better than without.

Sequences here start at arbitrary positions (tens of thousands) and own pages only for
the positions they write.
"""

from __future__ import annotations

import math
from dataclasses import replace

import conftest
import pytest
import torch
from conftest import DEVICE, assert_one_step_rarely, dyadic, needs_triton

from oscar_kernels import CacheLayout, LayerQuantParams, PagedKVCache, allocate_cache, paged_write
from oscar_math import Int2Quantized, dequantize_int2, quantize_int2, unpack_int2
from oscar_math.rope_center import rope_position_mean

FIELDS = PagedKVCache.TENSOR_FIELDS
KEY_INT2 = ("k_codes", "k_scale", "k_zero")


def inv_freq(d: int, base: float = 10000.0) -> torch.Tensor:
    """Llama-style RoPE inverse frequencies ``base^(-2i/d)`` (``θ_0 = 1``)."""
    return base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)


def rope_mean(h: int, d: int, pairs: list[int], gen: torch.Generator, exact: bool) -> torch.Tensor:
    """A dense pre-RoPE mean ``[h, d]``, non-zero on ``pairs`` only (both coordinates)."""
    m = torch.zeros(h, d)
    cols = torch.tensor(pairs + [p + d // 2 for p in pairs])
    if exact:
        m[:, cols] = dyadic(h, len(cols), gen=gen, scale=8, span=24)
    else:
        m[:, cols] = 3 * torch.randn(h, len(cols), generator=gen)
    return m


def make_params(
    h: int, d: int, gen: torch.Generator, *, exact: bool, rope: str = "freq", feedback: str = "",
    granularity: str = "kv_head",
) -> LayerQuantParams:  # fmt: skip
    """Rotations, key mean, clip ratios (as ``conftest.make_params``) plus a pre-RoPE mean on
    three low-frequency pairs (``θ ≤ 10^-2``: the ones calibration selects, periods comparable
    to the context; at ``θ ≈ 1`` the float32 angle alone is ``2^-24·p`` rad off the float64
    reference, which test_kernel_offset_is_float64_rope_within_float32_angle_rounding bounds).
    ``rope``: ``"freq"`` (real inverse frequencies), ``"zero"`` (all ``θ = 0``: the offset is
    ``m`` at every position) or ``""``."""
    params = conftest.make_params(h, d, granularity, gen, exact=exact, feedback=feedback)
    if not rope:
        return params
    half = d // 2
    return replace(
        params,
        k_rope_mean=rope_mean(h, d, [half // 2, half - 2, half - 1], gen, exact),
        k_rope_inv_freq=inv_freq(d).float() if rope == "freq" else torch.zeros(half),
    )


def without_rope(p: LayerQuantParams) -> LayerQuantParams:
    return replace(p, k_rope_mean=None, k_rope_inv_freq=None)


class Scenario:
    """Sequences ``b`` covering positions ``[starts[b], ends[b])``, pages scattered at random
    (only the pages the positions touch exist), written by ``cuts`` (chunk ends, relative
    to each start) and then ``steps`` one-token decode steps."""

    def __init__(self, lo: CacheLayout, starts, ends, gen: torch.Generator, keys=None, values=None):
        self.lo, self.starts, self.ends = lo, list(starts), list(ends)
        ps, h, d = lo.page_size, lo.num_kv_heads, lo.head_dim
        self.page_of = []  # per sequence: logical page -> physical page
        logical = [range(s // ps, (e - 1) // ps + 1) for s, e in zip(starts, ends, strict=True)]
        perm = torch.randperm(sum(len(r) for r in logical) + 2, generator=gen).tolist()
        self.num_pages = len(perm)
        for r in logical:
            self.page_of.append({lp: perm.pop() for lp in r})
        self.ws = torch.randperm(len(starts) + 1, generator=gen)[: len(starts)].int()
        n = [e - s for s, e in zip(starts, ends, strict=True)]
        self.keys = keys or [(dyadic(k, h, d, gen=gen) + 0.5).bfloat16() for k in n]
        self.values = values or [dyadic(k, h, d, gen=gen).bfloat16() for k in n]
        self.garbage = torch.randint(
            0, 256, (2, self.num_pages * h * ps * d // 4), generator=gen, dtype=torch.uint8
        )

    def slot(self, b: int, p: int) -> int:
        ps = self.lo.page_size
        return self.page_of[b][p // ps] * ps + p % ps

    def fill(
        self, params, backend: str, cuts=(), steps: int = 0, precise: bool = False, split: bool = False,
        block_t: int | None = None, fuse: bool | None = None, decode_parts: tuple[str, ...] = ("all",),
    ):  # fmt: skip
        """A fresh cache written with ``params``; ``split``: chunks as ``parts="pages"`` then
        ``"ring"`` (the extend order), decode steps as ``decode_parts``. ``block_t``: Triton tokens
        per program (16: most programs hold no BF16 row and skip the second rotation). ``fuse``: K
        and V in one launch (``paged_write``'s ``fuse``)."""
        lo = self.lo
        cache = allocate_cache(lo, self.num_pages, len(self.starts) + 1, DEVICE)
        for t, g in zip((cache.k_codes, cache.v_codes), self.garbage, strict=True):
            t.copy_(g.reshape(t.shape))
        nb = len(self.starts)
        lens = [e - s for s, e in zip(self.starts, self.ends, strict=True)]
        pre = [max(0, n - steps) for n in lens]
        done = [0] * nb
        chunks = []
        for c in [*sorted(cuts), max(pre)]:
            nxt = [min(p, max(dn, c)) for p, dn in zip(pre, done, strict=True)]
            chunks.append((done, nxt, ("pages", "ring") if split else ("all",)))
            done = nxt
        for s in range(steps):
            cur = [min(n, p + s) for n, p in zip(lens, pre, strict=True)]
            chunks.append((cur, [min(n, c + 1) for n, c in zip(lens, cur, strict=True)], decode_parts))
        for first, last, passes in chunks:
            rows = [(b, i) for b in range(nb) for i in range(first[b], last[b])]
            if not rows:
                continue
            pos = torch.tensor([self.starts[b] + i for b, i in rows])
            call = (
                cache,
                params,
                torch.stack([self.keys[b][i] for b, i in rows]).to(DEVICE),
                torch.stack([self.values[b][i] for b, i in rows]).to(DEVICE),
                torch.tensor([self.slot(b, int(p)) for (b, _), p in zip(rows, pos, strict=True)]).to(DEVICE),
                pos.int().to(DEVICE),
                torch.tensor([b for b, _ in rows], dtype=torch.int32, device=DEVICE),
                torch.tensor([s + n for s, n in zip(self.starts, last, strict=True)], dtype=torch.int32).to(
                    DEVICE
                ),
                self.ws.to(DEVICE),
            )
            for parts in passes:
                paged_write(*call, backend=backend, precise=precise, parts=parts, block_t=block_t, fuse=fuse)
        return cache

    def int2_rows(self, cache: PagedKVCache, name: str = "k") -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions [n], dequantised INT2 rows [n, H, d])`` of every written token."""
        pos, pages, offs = [], [], []
        ps = self.lo.page_size
        for b, (s, e) in enumerate(zip(self.starts, self.ends, strict=True)):
            for p in range(s, e):
                sl = self.slot(b, p)
                pos.append(p), pages.append(sl // ps), offs.append(sl % ps)
        pg, of = torch.tensor(pages), torch.tensor(offs)
        q = Int2Quantized(
            getattr(cache, f"{name}_codes")[pg, :, of].cpu(),
            getattr(cache, f"{name}_scale")[pg, :, of].cpu(),
            getattr(cache, f"{name}_zero")[pg, :, of].cpu(),
            self.lo.group,
        )
        return torch.tensor(pos), dequantize_int2(q)


def assert_same(a: PagedKVCache, b: PagedKVCache, fields=FIELDS) -> None:
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        n_bad = int((x != y).sum())
        assert n_bad == 0, f"{f}: {n_bad} of {x.numel()} elements differ"


# positions from 0 (sink rows) into the tens of thousands; page sizes 5 and 7 do not divide them
STARTS = [0, 9, 31_997, 65_531]
ENDS = [23, 30, 32_041, 65_547]


@needs_triton
@pytest.mark.parametrize(
    "d, h, page, group, sink, recent, feedback, fill",
    [
        (64, 2, 5, 16, 4, 6, "", "chunks+steps"),
        (16, 3, 7, 4, 2, 3, "", "split-chunks"),
        (64, 1, 8, None, 3, 5, "k", "steps"),
        (16, 2, 5, 8, 0, 0, "kv", "prefill"),
    ],
)
def test_triton_rope_write_is_exact_with_constant_offsets(d, h, page, group, sink, recent, feedback, fill):
    """All ``θ = 0``: ``RoPE_p(m) = m`` exactly on both sides (cos 0 = 1, sin 0 = 0), so with an
    exact rotation (signed Hadamard 16/64, dyadic keys and mean) the Triton write equals the
    reference bit for bit — INT2 rows centred by ``m``, BF16 rows not — on every device."""
    gen = torch.Generator().manual_seed(d * h + page)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=recent)
    params = make_params(h, d, gen, exact=True, rope="zero", feedback=feedback)
    sc = Scenario(lo, STARTS, ENDS, gen)
    kw = {
        "chunks+steps": {"cuts": [3, 11], "steps": 2, "block_t": 16},
        "split-chunks": {"cuts": [5], "steps": 1, "split": True, "block_t": 16},
        "steps": {"steps": 2},
        "prefill": {},
    }[fill]
    a = sc.fill(params, "triton", **kw)
    b = sc.fill(params, "torch", **kw)
    assert_same(a, b)
    # and the centring is not a no-op: without the pre-RoPE mean the key codes differ
    c = sc.fill(without_rope(params), "torch", **kw)
    assert (a.k_codes != c.k_codes).float().mean() > 0.1
    assert_same(a, c, [f for f in FIELDS if f not in KEY_INT2])


@needs_triton
@pytest.mark.parametrize(
    "d, h, page, group, sink, recent, feedback, granularity, block_t",
    [
        (64, 2, 5, 16, 4, 6, "", "kv_head", 16),
        (64, 3, 7, 32, 3, 5, "", "layer", None),
        (16, 2, 4, 4, 2, 3, "k", "kv_head", 16),
        (16, 1, 5, 8, 0, 4, "kv", "layer", None),
    ],
)
def test_triton_rope_write_matches_reference(d, h, page, group, sink, recent, feedback, granularity, block_t):
    """Real frequencies, positions to 65 546: the BF16 rows and the values are bit-exact
    (exact rotation); the key INT2 fields differ only where float32 vs float64 offsets (a
    few ulps) move a value across a rounding boundary — never in these seeds so far, allowed
    for 0.5 % (a wrong position or sign moves most of them)."""
    gen = torch.Generator().manual_seed(d + h + page)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=recent)
    params = make_params(h, d, gen, exact=True, feedback=feedback, granularity=granularity)
    sc = Scenario(lo, STARTS, ENDS, gen)
    a = sc.fill(params, "triton", cuts=[4], steps=2, precise=True, block_t=block_t)
    b = sc.fill(params, "torch", cuts=[4], steps=2)
    assert_same(a, b, [f for f in FIELDS if f not in KEY_INT2])
    for f in KEY_INT2:
        assert_one_step_rarely(f, getattr(a, f), getattr(b, f), 5e-3)


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("order", [("window", "codes"), ("codes", "window")])
@pytest.mark.parametrize(
    "starts, ends",
    [([0, 0, 31_997], [3, 23, 32_041]), ([0], [3])],
    ids=["mixed", "sink-only"],  # sink-only: every decode token of a launch lies in the sink
)
def test_a_decode_write_in_two_passes_is_the_one_pass_write(backend, order, starts, ends):
    """A decode step written as its BF16 rows (``"window"``: sink and ring) and its INT2 rows
    (``"codes"``) in two launches, in either order (``serving.run_layer`` runs the second beside
    the attention), leaves the cache bit for bit as the one ``"all"`` write — key feedback and a
    real pre-RoPE mean included, positions inside the sink (sequences of 3 tokens, sink 4; alone in
    a launch too), in the ring, across pages — and each pass alone stores only its own rows."""
    gen = torch.Generator().manual_seed(29)
    lo = CacheLayout(2, 64, page_size=5, group_size=16, sink_tokens=4, recent_tokens=6)
    params = make_params(2, 64, gen, exact=False, rope="freq", feedback="k")
    sc = Scenario(lo, starts, ends, gen)
    one = sc.fill(params, backend, cuts=[7], steps=3)
    two = sc.fill(params, backend, cuts=[7], steps=3, decode_parts=order)
    assert_same(one, two)
    int2 = [f for f in FIELDS if f.endswith(("codes", "scale", "zero"))]
    window = sc.fill(params, backend, cuts=[7], steps=3, decode_parts=("window",))
    codes = sc.fill(params, backend, cuts=[7], steps=3, decode_parts=("codes",))
    none = sc.fill(params, backend, cuts=[7], steps=3, decode_parts=())
    bf16 = [f for f in FIELDS if f not in int2]
    assert_same(window, one, bf16)
    assert_same(window, none, int2)
    assert_same(codes, one, int2)
    assert_same(codes, none, bf16)
    for fields in (int2, bf16):  # the decode steps wrote rows of both kinds
        assert any(not torch.equal(getattr(none, f), getattr(one, f)) for f in fields), fields


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bf16_rows_are_not_centred(backend):
    """The same writes with and without the pre-RoPE mean: sink and ring rows (K and V), and
    everything of V, are bit-identical; the key INT2 rows are not."""
    gen = torch.Generator().manual_seed(17)
    lo = CacheLayout(2, 64, page_size=5, group_size=16, sink_tokens=4, recent_tokens=7)
    params = make_params(2, 64, gen, exact=True)
    sc = Scenario(lo, STARTS, ENDS, gen)
    a = sc.fill(params, backend, cuts=[6], steps=3, precise=True, block_t=16)
    b = sc.fill(without_rope(params), backend, cuts=[6], steps=3, precise=True, block_t=16)
    assert_same(a, b, [f for f in FIELDS if f not in KEY_INT2])
    assert int(a.k_sink.ne(0).sum()) > 0 and int(a.k_recent.ne(0).sum()) > 0  # rows were written
    assert (a.k_codes != b.k_codes).float().mean() > 0.1


@needs_triton
@pytest.mark.parametrize("d, group", [(64, 4), (128, 8)])
def test_kernel_offset_is_float64_rope_within_float32_angle_rounding(d, group):
    """Keys equal to the float64 ``RoPE_p(m)`` (float32), identity rotation, no key mean, no
    clip: the reference's centred rows are exactly 0 (scale = zero = 0); the kernel's are its
    own offset's error, which the stored zero (the group minimum) and scale (range / 3)
    bound. Allowed per group: ``|m|·(2^-24·p·θ + 2^-20)`` over the group's columns (the
    float32 angle's rounding plus a few ulps of cos/sin and the products). A position off by
    one or a flipped sin moves the low-frequency pairs by ``|m|·θ ≫`` that."""
    gen = torch.Generator().manual_seed(d)
    h = 2
    lo = CacheLayout(h, d, page_size=16, group_size=group, sink_tokens=0, recent_tokens=0)
    freq = inv_freq(d).float()
    m = torch.zeros(h, d)
    m[:] = 4 * torch.randn(h, d, generator=gen)  # every pair, all frequencies
    eye = torch.eye(d)
    params = LayerQuantParams(eye, eye, k_rope_mean=m, k_rope_inv_freq=freq)
    pos = torch.cat([torch.arange(40), torch.randint(40, 100_000, (88,), generator=gen)])
    key = rope_position_mean(m, pos, freq)  # [n, h, d] float32
    n = pos.numel()
    cache = allocate_cache(lo, n // 16, 1, DEVICE)
    args = (
        key.to(DEVICE),
        torch.zeros(n, h, d, device=DEVICE),
        torch.arange(n, device=DEVICE),
        pos.int().to(DEVICE),
        torch.zeros(n, dtype=torch.int32, device=DEVICE),
        torch.tensor([100_000], dtype=torch.int32, device=DEVICE),
        torch.zeros(1, dtype=torch.int32, device=DEVICE),
    )
    paged_write(cache, params, *args, backend="triton", precise=True)
    pg, off = torch.arange(n) // 16, torch.arange(n) % 16
    zero = cache.k_zero[pg, :, off].float().cpu()  # [n, h, d / group]
    scale = cache.k_scale[pg, :, off].float().cpu()
    half = d // 2
    mabs = m.abs() + torch.cat((m[:, half:], m[:, :half]), 1).abs()  # |Δcos|·|m_c| + |Δsin|·|m'_c|
    ang = pos.double()[:, None] * torch.cat((freq, freq)).double()[None, :]  # [n, d]
    tol = (mabs[None] * (2**-24 * ang[:, None, :] + 2**-20)).reshape(n, h, d // group, group).amax(-1)
    tol = 1.01 * tol.float() + 1e-30
    assert (zero.abs() <= tol).all(), float((zero.abs() / tol).max())
    assert (3 * scale <= 2 * tol).all(), float((3 * scale / (2 * tol)).max())
    assert zero.ne(0).any()  # the kernel's float32 offset is not bit-equal to float64 (else: vacuous)
    paged_write(cache, params, *args, backend="torch")
    assert cache.k_zero.eq(0).all() and cache.k_scale.eq(0).all()


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("feedback", ["", "k"], ids=["nearest", "feedback"])
def test_centred_rows_reconstruct_keys_with_a_rotating_mean(backend, feedback):
    """``k_p = RoPE_p(m) + noise`` (``|m| ≈ 3``, noise σ = 0.3, random rotations): the INT2 row
    dequantised plus ``RoPE_p(m)`` is the key within the INT2 error of the noise itself
    (quantised directly by ``oscar_math``), and several times closer than without the
    pre-RoPE mean (where the INT2 range must hold the rotating mean)."""
    gen = torch.Generator().manual_seed(29 + len(feedback))
    h, d = 2, 64
    lo = CacheLayout(h, d, page_size=5, group_size=32, sink_tokens=2, recent_tokens=4)
    params = make_params(h, d, gen, exact=False, feedback=feedback)
    from dataclasses import replace

    params = replace(params, k_mean=None, k_clip=1.0)
    # a rotating mean on half the pairs, low and high frequencies
    m = rope_mean(h, d, list(range(0, d // 2, 2)), gen, exact=False)
    params = replace(params, k_rope_mean=m)
    starts, ends = [0, 1_000, 30_011], [17, 1_030, 30_040]
    keys, noise = [], []
    for s, e in zip(starts, ends, strict=True):
        z = 0.3 * torch.randn(e - s, h, d, generator=gen)
        noise.append(z)
        keys.append(rope_position_mean(m, torch.arange(s, e), params.k_rope_inv_freq) + z)
    sc = Scenario(lo, starts, ends, gen, keys=keys, values=[torch.randn_like(k) for k in keys])
    ep = params.expand(h, d, torch.device("cpu"))
    k = torch.cat(keys)
    err = {}
    for name, p in (("rope", params), ("plain", without_rope(params))):
        cache = sc.fill(p, backend, cuts=[9], steps=1, precise=True)
        pos, xr = sc.int2_rows(cache)
        khat = torch.einsum("nhe,hde->nhd", xr, ep.k_rotation)  # un-rotate (R orthogonal)
        if name == "rope":
            khat = khat + rope_position_mean(m, pos, params.k_rope_inv_freq)
        err[name] = float((khat - k).pow(2).mean().sqrt())
    zr = torch.einsum("nhd,hde->nhe", torch.cat(noise), ep.k_rotation)
    if feedback:
        from oscar_math.feedback import quantize_int2_feedback

        qz = quantize_int2_feedback(zr, lo.group, ep.k_feedback, clip_ratio=1.0)
    else:
        qz = quantize_int2(zr, lo.group, clip_ratio=1.0)
    floor = float((dequantize_int2(qz) - zr).pow(2).mean().sqrt())
    assert err["rope"] <= 1.02 * floor, (err, floor)
    assert err["plain"] >= 3 * err["rope"], err


@needs_triton
@pytest.mark.skipif(
    DEVICE.type != "cuda", reason="tf32 exists on the GPU only (the interpreter rotates in fp32)"
)
def test_triton_rope_write_tf32_close_to_reference():
    """Default (tf32) rotation of centred rows on the GPU: codes rarely one step apart (the
    same bound as the write without a pre-RoPE mean), scales within one bf16 step."""
    gen = torch.Generator().manual_seed(41)
    lo = CacheLayout(8, 128, page_size=16, group_size=128, sink_tokens=4, recent_tokens=8)
    params = make_params(8, 128, gen, exact=False)
    sc = Scenario(lo, STARTS, ENDS, gen)
    a = sc.fill(params, "triton", cuts=[7], steps=2)
    b = sc.fill(params, "torch", cuts=[7], steps=2)
    diff = unpack_int2(a.k_codes).int() - unpack_int2(b.k_codes).int()
    assert (diff != 0).float().mean() <= 5e-3 and diff.abs().max() <= 1
    xf, yf = a.k_scale.float(), b.k_scale.float()
    assert ((xf - yf).abs() <= 2**-7 * yf.abs() + 1e-6).float().mean() >= 0.99


def test_rope_params_are_validated():
    from oscar_math import OscarError

    eye = torch.eye(8)
    with pytest.raises(OscarError, match="both or neither"):
        LayerQuantParams(eye, eye, k_rope_mean=torch.zeros(8)).expand(2, 8, torch.device("cpu"))
    with pytest.raises(OscarError, match="shape of k_rope_inv_freq"):
        LayerQuantParams(eye, eye, k_rope_mean=torch.zeros(8), k_rope_inv_freq=torch.ones(8)).expand(
            2, 8, torch.device("cpu")
        )
    assert math.isclose(float(inv_freq(8)[0]), 1.0)


@needs_triton
@pytest.mark.parametrize(
    "rope, feedback, block_t, fill",
    [
        ("freq", "", 16, "chunks+steps"),
        ("freq", "k", 16, "split-chunks"),
        ("", "v", 32, "steps"),
        ("", "", None, "split-chunks"),
    ],
)
def test_one_launch_for_k_and_v_writes_what_two_launches_do(rope, feedback, block_t, fill):
    """``fuse=True`` (K and V programs in one grid, ``paged_write_kv_kernel``) against one launch per
    tensor, same tiles: bit for bit on every field — each program computes exactly what its own
    launch would, so a value head given a key's mean, rotation, feedback or RoPE offset, or a head
    index off by one, shows. Random (not exact) keys and real frequencies; chunks of more and fewer
    tokens than a tile, decode steps, the split extend order; sink and ring rows."""
    gen = torch.Generator().manual_seed(len(feedback) + (block_t or 0))
    h, d = 2, 32
    lo = CacheLayout(h, d, page_size=5, group_size=16, sink_tokens=4, recent_tokens=6)
    params = make_params(h, d, gen, exact=False, rope=rope, feedback=feedback)
    starts, ends = [0, 9, 31_997], [14, 21, 32_011]  # sink rows, a short sequence, a far position
    n = [e - s for s, e in zip(starts, ends, strict=True)]
    keys = [(torch.randn(k, h, d, generator=gen) * 2 + 0.5).bfloat16() for k in n]
    values = [torch.randn(k, h, d, generator=gen).bfloat16() for k in n]
    sc = Scenario(lo, starts, ends, gen, keys=keys, values=values)
    kw = {
        "chunks+steps": {"cuts": [5], "steps": 3},
        "split-chunks": {"cuts": [7], "split": True, "steps": 1},
        "steps": {"steps": 4},
    }[fill]
    # fp32 rotations (tf32 on the GPU moves window rows by a bf16 step too often to compare with
    # the reference below; the default-precision fused path is in the other write tests)
    one = sc.fill(params, "triton", block_t=block_t, fuse=True, precise=True, **kw)
    two = sc.fill(params, "triton", block_t=block_t, fuse=False, precise=True, **kw)
    assert_same(one, two)
    # and both are the write (the reference within the fp32 rotation's summation order)
    ref = sc.fill(params, "torch", **kw)
    for f in ("v_codes", "k_sink", "v_recent"):
        assert_one_step_rarely(f, getattr(one, f), getattr(ref, f), 5e-3)


@needs_triton
def test_one_launch_with_a_per_layer_key_rotation_and_per_head_value_rotations():
    """A per-layer rotation is broadcast over heads (stride 0), a per-head one is not: the one-launch
    kernel passes one set of rotation strides, so the write must take two launches then (or the
    value heads read the wrong rotation)."""
    gen = torch.Generator().manual_seed(31)
    h, d = 2, 32
    lo = CacheLayout(h, d, page_size=5, group_size=16, sink_tokens=4, recent_tokens=6)
    params = make_params(h, d, gen, exact=False, rope="", granularity="kv_head")
    params = replace(params, k_rotation=params.k_rotation[0], k_mean=params.k_mean[0])
    starts, ends = [0, 31_997], [12, 32_006]
    n = [e - s for s, e in zip(starts, ends, strict=True)]
    keys = [(torch.randn(k, h, d, generator=gen) * 2 + 0.5).bfloat16() for k in n]
    values = [torch.randn(k, h, d, generator=gen).bfloat16() for k in n]
    sc = Scenario(lo, starts, ends, gen, keys=keys, values=values)
    auto = sc.fill(params, "triton", precise=True, steps=3)  # decode steps: the one-launch default
    two = sc.fill(params, "triton", precise=True, steps=3, fuse=False)
    assert_same(auto, two)
