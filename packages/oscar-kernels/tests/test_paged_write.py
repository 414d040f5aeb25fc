import pytest
import torch
from conftest import DEVICE, assert_one_step_rarely, compile_check_ptx, fill_cache, needs_triton

from oscar_kernels import CacheLayout, PagedKVCache
from oscar_math import quantize_int2, unpack_int2

FIELDS = PagedKVCache.TENSOR_FIELDS


def test_reference_write_matches_quantize_int2():
    gen = torch.Generator().manual_seed(3)
    lo = CacheLayout(2, 32, page_size=8, group_size=16, sink_tokens=3, recent_tokens=5)
    cache, params, bt, ws, keys, values = fill_cache(lo, [21], gen, "kv_head")
    ep = params.expand(2, 32, cache.device)
    kr = torch.einsum("nhd,hde->nhe", keys[0].float() - ep.k_mean, ep.k_rotation)
    q = quantize_int2(kr, 16, ep.k_clip[:, None])
    p = torch.arange(21)
    pg, off = bt[0].long()[p // 8], p % 8
    assert torch.equal(cache.k_codes[pg, :, off], q.codes)
    assert torch.equal(cache.k_scale[pg, :, off], q.scale)
    # sink holds positions 0..2, the ring the last 5 at row p % 5
    assert torch.equal(cache.k_sink[ws[0], :, :3].transpose(0, 1), kr[:3].bfloat16())
    rows = torch.arange(16, 21) % 5
    assert torch.equal(cache.k_recent[ws[0], :, rows].transpose(0, 1), kr[16:].bfloat16())


@needs_triton
@pytest.mark.parametrize(
    "d, h, page, group, sink, recent, granularity",
    [(64, 2, 16, None, 5, 12, "layer"), (64, 3, 8, 16, 4, 6, "kv_head"), (16, 2, 4, 4, 2, 3, "kv_head")],
)
def test_triton_write_is_exact_when_the_rotation_is(d, h, page, group, sink, recent, granularity):
    """Signed-Hadamard rotations of dyadic keys are exact in fp32 *and* tf32, and the rest of
    the kernel is exact by construction: the write must equal the reference bit for bit, on
    every device and at the default precision (a truncating bf16 rounding fails here)."""
    gen = torch.Generator().manual_seed(d * h)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=recent)
    lens = [1, sink + recent, sink + recent + 1, 37]
    state = gen.get_state()
    a = fill_cache(lo, lens, gen, granularity, backend="triton", steps=2, exact=True)[0]
    gen.set_state(state)
    b = fill_cache(lo, lens, gen, granularity, backend="torch", steps=2, exact=True)[0]
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        n_bad = int((x != y).sum())
        assert n_bad == 0, f"{f}: {n_bad} of {x.numel()} elements differ"


@needs_triton
@pytest.mark.parametrize(
    "precise",
    [
        True,
        pytest.param(
            False,
            marks=pytest.mark.skipif(
                DEVICE.type != "cuda", reason="tf32 exists on the GPU only (the interpreter rotates in fp32)"
            ),
        ),
    ],
    ids=["fp32", "tf32"],
)
@pytest.mark.parametrize(
    "d, h, page, group, sink, recent, granularity",
    [
        (64, 2, 16, None, 5, 12, "layer"),
        (64, 3, 8, 32, 4, 6, "kv_head"),
        (128, 1, 16, 64, 0, 9, "layer"),
        (32, 2, 4, 8, 2, 0, "kv_head"),
    ],
)
def test_triton_write_matches_reference(d, h, page, group, sink, recent, granularity, precise):
    gen = torch.Generator().manual_seed(d + h)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=recent)
    lens = [1, sink + recent, sink + recent + 1, 37]
    state = gen.get_state()
    a = fill_cache(lo, lens, gen, granularity, backend="triton", steps=2, precise=precise)[0]
    gen.set_state(state)
    b = fill_cache(lo, lens, gen, granularity, backend="torch", steps=2)[0]
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        if x.numel() == 0:
            continue
        if precise:
            # fp32 rotation (always under the interpreter): only the summation order of the
            # rotation differs from torch's, so a rotated value a few ulps from a bf16
            # rounding midpoint may round the other way (at most 1 element of 640 here; 0 on
            # the H200 with precise=True), while a wrong rounding mode moves 25-38 % of them.
            # Bit-exactness itself: test_triton_write_is_exact_when_the_rotation_is.
            assert_one_step_rarely(f, x, y, 5e-3)
        elif f.endswith("codes"):
            # tf32 rotation: rotated values move by ~1e-3 relative, so a code flips by one
            # step where a value sits near a rounding tie; measured 0.10-0.21 % of codes on
            # the H200 (lab/results/kernels/h200_check.json), never by more than one step
            diff = unpack_int2(x).int() - unpack_int2(y).int()
            assert (diff != 0).float().mean() <= 5e-3 and diff.abs().max() <= 1, f
        else:
            # tf32 moves min/max (and the bf16 window rows) across a bf16 rounding boundary:
            # 6-15 % of scales are not bit-equal on the H200, off by one bf16 step (2^-7
            # relative at most); window rows differ by at most one step (0.0625 at |x| < 16)
            xf, yf = x.float(), y.float()
            close = (xf - yf).abs() <= 2**-7 * yf.abs() + 1e-6
            # tf32 rotation on a GPU: 98.2 % of window values within 2^-7 (H200, 2026-11-30)
            want = 0.97 if torch.cuda.is_available() else 0.99
            assert close.float().mean() >= want and torch.equal(xf == 0, yf == 0), f


# ---------------------------------------------------------------------------------------------
# error-feedback codes (artifact format version 2)


def test_reference_write_with_feedback_matches_quantize_int2_feedback():
    from oscar_math.feedback import quantize_int2_feedback

    gen = torch.Generator().manual_seed(5)
    lo = CacheLayout(2, 32, page_size=8, group_size=16, sink_tokens=3, recent_tokens=5)
    cache, params, bt, ws, keys, values = fill_cache(lo, [21], gen, "kv_head", feedback="kv")
    ep = params.expand(2, 32, cache.device)
    p = torch.arange(21)
    pg, off = bt[0].long()[p // 8], p % 8
    kr = torch.einsum("nhd,hde->nhe", keys[0].float() - ep.k_mean, ep.k_rotation)
    vr = torch.einsum("nhd,hde->nhe", values[0].float(), ep.v_rotation)
    qk = quantize_int2_feedback(kr, 16, ep.k_feedback, ep.k_clip[:, None])
    qv = quantize_int2_feedback(vr, 16, ep.v_feedback, ep.v_clip[:, None])
    assert torch.equal(cache.k_codes[pg, :, off], qk.codes)
    assert torch.equal(cache.v_codes[pg, :, off], qv.codes)
    assert torch.equal(cache.k_scale[pg, :, off], qk.scale)
    # and the feedback is not a no-op: plain rounding gives other codes for a good share
    plain = quantize_int2(kr, 16, ep.k_clip[:, None])
    changed = (unpack_int2(plain.codes) != unpack_int2(qk.codes)).float().mean()
    assert changed > 0.1, float(changed)


@needs_triton
@pytest.mark.parametrize(
    "d, h, page, group, sink, recent, granularity, feedback",
    [
        (64, 1, 16, None, 5, 12, "layer", "kv"),
        (16, 3, 8, 8, 4, 6, "kv_head", "k"),
        (16, 2, 4, 4, 2, 3, "kv_head", "v"),
        (16, 1, 5, 8, 0, 0, "kv_head", "kv"),
        # eight coordinates a step (d a multiple of 32) over groups of four: two groups a step
        # (exact rotations exist at powers of four: d = 64)
        (64, 2, 8, 4, 3, 5, "kv_head", "k"),
    ],
)
def test_triton_feedback_write_is_exact_when_the_rotation_is(
    d, h, page, group, sink, recent, granularity, feedback
):
    """With an exact rotation (signed Hadamard of order 16 or 64, exact in tf32 too) the
    feedback loop (the same float32 operations in the same order as
    ``oscar_math.quantize_int2_feedback``) must give the reference's codes bit for bit, across
    page boundaries (page sizes 5, 8, 16 against 37-token sequences) and decode steps."""
    gen = torch.Generator().manual_seed(d * h + 7)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=recent)
    # (the interpreter runs the d-step loop slowly: few heads and one decode step per case)
    lens = [1, sink + recent + 1, 37]
    state = gen.get_state()
    a = fill_cache(lo, lens, gen, granularity, backend="triton", steps=1, exact=True, feedback=feedback)[0]
    gen.set_state(state)
    b = fill_cache(lo, lens, gen, granularity, backend="torch", steps=1, exact=True, feedback=feedback)[0]
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        n_bad = int((x != y).sum())
        assert n_bad == 0, f"{f}: {n_bad} of {x.numel()} elements differ"


@needs_triton
def test_only_small_feedback_writes_run_in_chunks(monkeypatch):
    """The plan's ``feedback_rows`` (a kernel constexpr): chunks for a feedback write of at most
    ``FEEDBACK_CHUNK_MAX_TOKENS`` tokens, the whole tile above, and 0 wherever no feedback loop runs
    (plain tensors, ring-only passes), so those keep one build for every token count."""
    import importlib

    from conftest import make_params

    from oscar_kernels import allocate_cache, plan_write

    pw = importlib.import_module("oscar_kernels.paged_write")  # the module (the package exports the op)
    n = pw.FEEDBACK_CHUNK_MAX_TOKENS
    lo = CacheLayout(2, 16, page_size=4, sink_tokens=2, recent_tokens=3)
    cache = allocate_cache(lo, 4, 2, DEVICE)
    gen = torch.Generator().manual_seed(0)
    fb = make_params(2, 16, "kv_head", gen, feedback="k").expand(2, 16, DEVICE)
    plain = make_params(2, 16, "kv_head", gen).expand(2, 16, DEVICE)
    one = plan_write(cache, fb, n, backend="triton")
    assert one.feedback_rows == pw.FEEDBACK_CHUNK_ROWS == 4 and one.k_tile[1] == 4  # one row a warp
    assert plan_write(cache, fb, n + 1, backend="triton").feedback_rows == 0
    # with the wide chunk on (FEEDBACK_CHUNK_MAX_TOKENS 8): 5-8 tokens in one 8-row chunk, 8 warps
    monkeypatch.setattr(pw, "FEEDBACK_CHUNK_MAX_TOKENS", 8)
    wide = plan_write(cache, fb, 5, backend="triton")
    assert wide.feedback_rows == plan_write(cache, fb, 8, backend="triton").feedback_rows == 8
    assert wide.k_tile[1] == 8  # one row a warp
    assert plan_write(cache, fb, 9, backend="triton").feedback_rows == 0
    assert plan_write(cache, fb, 4, backend="triton").feedback_rows == 4
    assert plan_write(cache, fb, 1, "ring", backend="triton").feedback_rows == 0
    assert plan_write(cache, plain, 1, backend="triton").feedback_rows == 0


@needs_triton
@pytest.mark.parametrize("narrow_max", [10**6, 0])
def test_feedback_rows_in_chunks_are_exact(monkeypatch, narrow_max):
    """Every write runs its feedback loop in chunks of ``FEEDBACK_CHUNK_ROWS`` rows (a decode
    write's way, here for the prefill too): 37-token sequences in 16- and 32-token tiles, so
    chunks over the tile's real rows only, a partial last chunk, page boundaries; bit for bit the
    reference's codes."""
    import importlib

    pw = importlib.import_module("oscar_kernels.paged_write")  # the module (the package exports the op)
    monkeypatch.setattr(pw, "FEEDBACK_CHUNK_MAX_TOKENS", 10**6)
    # every write in chunks of 4 rows (narrow_max large), or in chunks of 8 (narrow_max 0)
    monkeypatch.setattr(pw, "FEEDBACK_CHUNK_ROWS", 4 if narrow_max else 0)
    monkeypatch.setattr(pw, "FEEDBACK_WIDE_CHUNK_ROWS", 4 if narrow_max else 8)
    lo = CacheLayout(2, 16, page_size=5, group_size=8, sink_tokens=3, recent_tokens=4)
    _assert_triton_fills_like_torch(lo, [1, 8, 37], seed=11, steps=2, feedback="kv")


def _assert_triton_fills_like_torch(lo: CacheLayout, lens: list[int], seed: int, **kw) -> None:
    """The same random cache filled through the Triton write and the torch reference (``fill_cache``
    with ``exact=True`` and ``kw``): every field bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    state = gen.get_state()
    a = fill_cache(lo, lens, gen, "kv_head", backend="triton", exact=True, **kw)[0]
    gen.set_state(state)
    b = fill_cache(lo, lens, gen, "kv_head", backend="torch", exact=True, **kw)[0]
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@needs_triton
def test_decode_steps_of_six_sequences_run_one_wide_chunk_exactly(monkeypatch):
    """Six sequences' decode steps with the wide chunk on (6 tokens a write: one chunk of
    FEEDBACK_WIDE_CHUNK_ROWS rows, two of them padding) give the reference's codes bit for bit."""
    import importlib

    pw = importlib.import_module("oscar_kernels.paged_write")
    monkeypatch.setattr(pw, "FEEDBACK_CHUNK_MAX_TOKENS", 8)
    assert pw._feedback_rows(6) == 8
    lo = CacheLayout(2, 16, page_size=5, group_size=8, sink_tokens=3, recent_tokens=4)
    _assert_triton_fills_like_torch(lo, [1, 2, 5, 6, 9, 12], seed=13, steps=3, feedback="kv")


@needs_triton
@pytest.mark.parametrize("layout", ["column-major", "row-major"])
def test_feedback_matrices_are_read_in_any_layout(layout, monkeypatch):
    """``expand`` stores ``F`` column-major (the loop reads a column a step: one contiguous run);
    an :class:`ExpandedParams` built by hand may hold it row-major. The kernel reads ``F`` through
    both strides, so either layout gives the reference's codes bit for bit (a kernel that assumed
    one layout reads ``Fᵀ`` — strictly upper triangular — in the other and fails here)."""
    import dataclasses

    from oscar_kernels import LayerQuantParams

    expand = LayerQuantParams.expand

    def expand_in(self, *a, **kw):
        ep = expand(self, *a, **kw)
        h, d = ep.k_feedback.shape[:2]
        assert ep.k_feedback.stride() == (d * d, 1, d)  # the layout expand promises
        if layout == "row-major":
            ep = dataclasses.replace(ep, k_feedback=ep.k_feedback.contiguous())
        return ep

    monkeypatch.setattr(LayerQuantParams, "expand", expand_in)
    lo = CacheLayout(2, 16, page_size=4, group_size=8, sink_tokens=2, recent_tokens=3)
    _assert_triton_fills_like_torch(lo, [1, 11], seed=5, steps=1, feedback="k")


@needs_triton
@pytest.mark.parametrize(("fb_rows", "warps"), [(4, 4), (8, 8), (0, 4)])
def test_the_feedback_loop_waits_on_no_block_barrier(fb_rows, warps):
    """The error-feedback loop is a one-token decode write's latency (15.6 µs a layer on the H100,
    FA3's cache write 2.2). In the ``tl.dot`` (MMA) layout a quarter's columns lie in several warps
    and each cross-lane pick cost two block barriers (sm_90 PTX: 10 ``bar.sync`` per coordinate);
    relaid through the program's scratch, the four quarters' loops hold none (shuffles only)."""
    import importlib.util
    from pathlib import Path

    # a decode write's chunk of four or eight rows (one a warp), and the whole tile (larger writes)
    call = f"cc.compile_write_kv(num_warps={warps}, block_t=16, rope=True, feedback=True, fb_rows={fb_rows})"
    ptx = compile_check_ptx(call)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_check.py"
    spec = importlib.util.spec_from_file_location("compile_check", path)
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    # one run-time loop per quarter, inside the loop over row chunks
    loops = [lp for lp in cc.ptx_loops(ptx) if not lp["inner"]]
    assert len(loops) == 4, loops
    assert all(lp["bar.sync"] == 0 and lp["shfl.sync"] > 0 for lp in loops), loops
    assert "globaltimer" not in ptx  # the PROBE diagnosis stays out of the product build
    # F is asked for before the rotation (a 128-byte line per request: 512 over the threads), never
    # inside the loops, whose column loads are vectors of a column-major F (a step's first
    # quarter over the whole tile, four coordinates: 22 global loads, where row-major scalar column
    # loads made it 70; in the chunks eight coordinates, 32 column loads and 28 scalar entries: 60)
    # (and each program's R: the K and the V branch, 512 lines each)
    assert ptx.count("prefetch.global.L1") == 3 * 512 // (32 * warps), ptx.count("prefetch.global.L1")
    assert loops[0]["ld.global"] <= (64 if fb_rows else 24), loops


@needs_triton
@pytest.mark.parametrize("warps", [4, 8])
def test_the_window_pass_asks_for_its_rotation_before_its_bookkeeping(warps):
    """A decode step's window pass (``parts="window"``: the BF16 rows the attention waits for) loads
    ``R`` a quarter at a time, each after the dot before it: the rotation's lines (512 a head, K and
    V) are asked for into L1 first, before the slot and window bookkeeping loads, with no early
    return between (two branches: the K / V split and the PDL trigger's). The ring pass after an
    extend asks for none (most of its tiles hold no ring row and return)."""
    window = compile_check_ptx(f"cc.compile_write_kv(num_warps={warps}, parts='window', trigger=True)")
    lines = window.splitlines()
    pf = [i for i, ln in enumerate(lines) if "prefetch.global.L1" in ln]
    loads = [i for i, ln in enumerate(lines) if "ld.global" in ln]
    assert len(pf) == 2 * 512 // (32 * warps), len(pf)
    assert pf[0] < loads[0] and pf[len(pf) // 2 - 1] < loads[0], (pf, loads[:4])
    assert sum("bra" in ln for ln in lines) <= 2
    ring = compile_check_ptx(f"cc.compile_write_kv(num_warps={warps}, parts='ring')")
    assert "prefetch.global.L1" not in ring


@needs_triton
@pytest.mark.parametrize("d", [16, 32, 64])
def test_the_feedback_prefetch_compiles_at_every_head_dim(d):
    """The prefetch (GPU launches only: the interpreter never builds it) asks for one line per 32
    rows of each column, at least one row block: d = 16 once built ``arange(0, 0)`` and failed to
    compile on the GPU while every CPU test passed."""
    call = f"cc.compile_write_kv(num_warps=4, block_t=16, rope=False, feedback=True, head_dim={d})"
    ptx = compile_check_ptx(call)
    assert ptx.count("prefetch.global.L1") >= 1


def test_the_probe_build_stamps_each_phase_outside_the_loops():
    """``PROBE`` (``lab/gpu_vllm/write_phases.py``: where a decode write's time goes) reads the GPU
    timer at each phase boundary — 9 in a key program with feedback (start, rotation, staging,
    group statistics, four quarters, end), 3 in a value program without — and never inside the
    feedback loops, which stay barrier-free."""
    import importlib.util
    from pathlib import Path

    call = "cc.compile_write_kv(num_warps=4, block_t=16, rope=True, feedback=True, probe=True)"
    ptx = compile_check_ptx(call)
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_check.py"
    spec = importlib.util.spec_from_file_location("compile_check", path)
    cc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cc)
    assert ptx.count("%globaltimer") == 12
    # the four quarters' step loops (inside the loop over row chunks, one chunk in a decode write)
    loops = [lp for lp in cc.ptx_loops(ptx) if not lp["inner"]]
    assert len(loops) == 4 and all(lp["bar.sync"] == 0 and lp["globaltimer"] == 0 for lp in loops), loops


@needs_triton
@pytest.mark.parametrize(
    "d, h, page, group, granularity", [(64, 1, 8, 32, "kv_head"), (32, 2, 4, 8, "layer")]
)
def test_triton_feedback_write_matches_reference(d, h, page, group, granularity):
    """Random (inexact) rotations, fp32: codes may differ where a rotated value sits a few ulps
    from a rounding tie — and with feedback a flipped code changes the targets after it, so
    the bound is looser than for plain rounding, but far below the >10 % a wrong loop gives."""
    gen = torch.Generator().manual_seed(d + h + 11)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=3, recent_tokens=5)
    lens = [9, 37, 20]
    state = gen.get_state()
    a = fill_cache(lo, lens, gen, granularity, backend="triton", precise=True, feedback="kv")[0]
    gen.set_state(state)
    b = fill_cache(lo, lens, gen, granularity, backend="torch", feedback="kv")[0]
    for f in ("k_codes", "v_codes"):
        diff = unpack_int2(getattr(a, f)).int() - unpack_int2(getattr(b, f)).int()
        assert (diff != 0).float().mean() <= 2e-2, (f, float((diff != 0).float().mean()))
    for f in ("k_scale", "k_zero", "v_scale", "v_zero"):
        assert_one_step_rarely(f, getattr(a, f), getattr(b, f), 5e-3)


def test_feedback_params_are_validated():
    from oscar_kernels import LayerQuantParams
    from oscar_math import OscarError

    eye = torch.eye(8)
    with pytest.raises(OscarError, match="shape of k_feedback"):
        LayerQuantParams(eye, eye, k_feedback=torch.zeros(3, 8, 8)).expand(2, 8, torch.device("cpu"))
    with pytest.raises(OscarError, match="strictly lower triangular"):
        LayerQuantParams(eye, eye, v_feedback=torch.ones(8, 8)).expand(2, 8, torch.device("cpu"))


def test_a_plan_of_another_write_is_refused():
    """``paged_write(plan=...)`` launches an engine step's plan; one made for another token count
    or other parts would launch the wrong grid: a one-line error instead."""
    from oscar_kernels import plan_write
    from oscar_math.errors import OscarError

    lo = CacheLayout(2, 16, page_size=4, sink_tokens=2, recent_tokens=3)
    cache, params, bt, ws, keys, values = fill_cache(lo, [5], torch.Generator().manual_seed(1), "kv_head")
    ep = params.expand(2, 16, cache.device) if hasattr(params, "expand") else params
    k = torch.randn(2, 2, 16)
    idx = (torch.tensor([0, 1]), torch.tensor([5, 6]), torch.zeros(2, dtype=torch.int64),
           torch.tensor([7]), ws[:1])  # fmt: skip
    from oscar_kernels import paged_write

    for other in (plan_write(cache, ep, 3, "all", "torch"), plan_write(cache, ep, 2, "pages", "torch")):
        with pytest.raises(OscarError, match="plan"):
            paged_write(cache, ep, k, k, *idx, backend="torch", plan=other)
