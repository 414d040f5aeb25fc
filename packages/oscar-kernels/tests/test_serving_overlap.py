"""``run_layer``'s decode write beside the attention (``overlap_write``): the BF16 window rows before
the attention, the INT2 rows on a second CUDA stream joined by ``join_layer``. The caches and the
outputs must be bit for bit those of the one-pass write, eagerly and replayed from a CUDA graph
(a capture with a forked stream), and no pass may be left unjoined."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, make_params, needs_triton

from oscar_kernels import CacheLayout, PagedKVCache, allocate_cache
from oscar_kernels.serving import StepPlan, beside, join_layer, plan_step, run_layer

FIELDS = PagedKVCache.TENSOR_FIELDS
#: the GPU's decode kernel needs d = 128 (its dots take d/8 >= 16); the interpreter is quicker at 32
D = 128 if HAS_CUDA else 32
LO = CacheLayout(2, D, page_size=8, group_size=16, sink_tokens=4, recent_tokens=8)
HQ = 8


def _decode_plan(lens: list[int], tables: list[list[int]]) -> StepPlan:
    """One decode token per sequence of ``lens`` (lengths after the step) in pages ``tables``."""
    b = len(lens)
    qsl = torch.arange(b + 1, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ps = LO.page_size
    slot = torch.tensor([tables[i][(n - 1) // ps] * ps + (n - 1) % ps for i, n in enumerate(lens)])
    ws = torch.arange(b, dtype=torch.int32)
    return plan_step(qsl.to(DEVICE), qsl, seq.to(DEVICE), seq, table.to(DEVICE), slot.to(DEVICE), b, ws, None)


def _case(seed: int):  # noqa: ANN202
    """A cache with garbage INT2 pages, key feedback, and three sequences' decode steps: one inside
    the sink (position 2), one in the ring, one across a page boundary (position 16)."""
    g = torch.Generator().manual_seed(seed)
    cache = allocate_cache(LO, 12, 4, DEVICE)
    for t in (cache.k_codes, cache.v_codes):
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))
    params = make_params(2, D, "kv_head", g, feedback="k").expand(2, D, DEVICE)
    lens, tables = [3, 13, 17], [[5], [1, 7], [2, 9, 11]]
    steps = []
    for s in range(3):
        step_lens = [n + s for n in lens]
        q = torch.randn(3, HQ, D, generator=g).bfloat16().to(DEVICE)
        k = (torch.randn(3, 2, D, generator=g) * 2 + 0.5).bfloat16().to(DEVICE)
        v = torch.randn(3, 2, D, generator=g).bfloat16().to(DEVICE)
        steps.append((step_lens, q, k, v))
    return cache, params, tables, steps


def _snapshot(cache: PagedKVCache) -> dict[str, torch.Tensor]:
    return {f: getattr(cache, f).clone() for f in FIELDS}


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_decode_write_beside_the_attention_changes_no_bit(backend):
    """Three decode steps of two layers with ``overlap_write`` on and off: the same caches and
    outputs (on a CPU the two passes run in order; on a GPU the INT2 pass runs on the second
    stream, and the second layer's query rotation beside its window pass where PDL exists)."""
    results = []
    for overlap in (False, True):
        cache, params, tables, steps = _case(3)
        layers = (cache, _clone(cache))
        outs = []
        for lens, q, k, v in steps:
            md = _decode_plan(lens, tables)
            for c in layers:  # the first layer plans the step's launches, the second runs them
                opts = dict(backend=backend, overlap_write=overlap, overlap_rotation=overlap)
                o = run_layer(md, c, params, q, k, v, D**-0.5, **opts)
                outs.append(o.clone())
                assert md.side == [], "run_layer returned with a pass unjoined"
        results.append(([_snapshot(c) for c in layers], outs))
    (c0, o0), (c1, o1) = results
    for a, b in zip(c0, c1, strict=True):
        for f in FIELDS:
            assert torch.equal(a[f], b[f]), f
    for a, b in zip(o0, o1, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(o1[0], o1[1])  # the two layers: the same inputs, the same outputs


@needs_triton
def test_layers_of_one_step_that_launch_one_kernel_two_ways_write_what_each_writes_alone():
    """Five layers of one decode step: the first plans the launches, the second records its
    compiled kernels, the later ones replay them (``launch.LaunchSequence``, on a GPU). Layers that
    launch ``paged_write_kv_kernel`` with other constexprs — a one-pass write after two-pass ones,
    a layer without a key mean among centred ones — must write what each writes alone, with a plan
    of its own (on the H100 a one-pass write replayed the window pass's kernel and wrote no INT2
    codes)."""
    import dataclasses

    cache, params, tables, steps = _case(5)
    lens, q, k, v = steps[0]
    no_mean = dataclasses.replace(params, has_mean=False, k_mean=torch.zeros_like(params.k_mean))
    layers = [(params, True), (params, True), (params, False), (no_mean, True), (params, True)]
    caches = [_clone(cache) for _ in layers]
    md = _decode_plan(lens, tables)
    opts = dict(backend="triton")
    outs = [
        run_layer(md, c, p, q, k, v, D**-0.5, overlap_write=w, **opts)
        for c, (p, w) in zip(caches, layers, strict=True)
    ]
    for i, (c, (p, w), o) in enumerate(zip(caches, layers, outs, strict=True)):
        alone = _clone(cache)
        o_alone = run_layer(_decode_plan(lens, tables), alone, p, q, k, v, D**-0.5, overlap_write=w, **opts)
        assert torch.equal(o, o_alone), i
        for f in FIELDS:
            assert torch.equal(getattr(c, f), getattr(alone, f)), (i, f)
    assert not torch.equal(caches[3].k_codes, caches[4].k_codes)  # the mean mattered


@needs_triton
def test_a_deferred_join_leaves_the_pass_to_join_layer():
    """``defer_join``: on a GPU the INT2 pass is left on the second stream for the caller (vLLM runs
    the window records beside it) and ``join_layer`` joins it; off CUDA nothing is pending."""
    cache, params, tables, steps = _case(5)
    lens, q, k, v = steps[0]
    md = _decode_plan(lens, tables)
    run_layer(md, cache, params, q, k, v, D**-0.5, defer_join=True)
    assert len(md.side) == (1 if DEVICE.type == "cuda" else 0)
    join_layer(md)
    assert md.side == []


@pytest.mark.skipif(not HAS_CUDA, reason="a CUDA graph with a forked stream needs a GPU")
def test_a_captured_step_with_the_write_beside_replays_the_one_pass_write():
    """A decode step captured in a CUDA graph with ``overlap_write`` (a capture whose second stream
    forks at the window pass and joins after the attention) replays to the caches and outputs of
    the same step run eagerly with the one-pass write."""
    cache_g, params, tables, steps = _case(7)
    cache_e = allocate_cache(LO, 12, 4, DEVICE)
    for f in FIELDS:
        getattr(cache_e, f).copy_(getattr(cache_g, f))
    lens, q, k, v = steps[0]
    md = _decode_plan(lens, tables)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compiles outside the capture, as vLLM's warm-up does
        run_layer(md, _clone(cache_g), params, q, k, v, D**-0.5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g = run_layer(md, cache_g, params, q, k, v, D**-0.5, overlap_write=True)
    graph.replay()
    out_e = run_layer(md, cache_e, params, q, k, v, D**-0.5, overlap_write=False)
    torch.cuda.synchronize()
    assert torch.equal(out_g, out_e)
    for f in FIELDS:
        assert torch.equal(getattr(cache_g, f), getattr(cache_e, f)), f


@pytest.mark.skipif(not HAS_CUDA, reason="a CUDA graph with a forked stream needs a GPU")
def test_a_captured_step_whose_passes_stay_open_past_their_layers_replays_the_one_pass_write():
    """vLLM's FULL graphs: each layer's INT2 pass and a copy of its ring rows (the window records'
    stand-in, run with ``beside``) stay on the second stream past the layer; the next layer's
    ``run_layer`` joins them before its own launches and the last layer joins its own. Replayed,
    three layers give the caches, copies and outputs of the eager one-pass write; the step's keys
    and values are held until their pass is joined."""
    layers = [_case(11 + i) for i in range(3)]
    eager = [_clone(c) for c, *_ in layers]
    md = _decode_plan(layers[0][3][0][0], layers[0][2])
    ks = [(torch.empty_like(c.k_recent), torch.empty_like(c.k_recent)) for c, *_ in layers]

    def step(caches, overlap: bool, open_passes: bool) -> list[torch.Tensor]:
        outs = []
        for i, (cache, (_, params, _, steps), copies) in enumerate(zip(caches, layers, ks, strict=True)):
            _, q, k, v = steps[0]
            opts = dict(overlap_write=overlap, defer_join=True, overlap_rotation=overlap)
            o = run_layer(md, cache, params, q, k, v, D**-0.5, **opts)
            outs.append(o)
            if overlap and open_passes:
                assert len(md.side) == 1 and len(md.keep) == 1, "an earlier layer's pass was not joined"
            with beside(md):
                copies[0 if open_passes else 1].copy_(cache.k_recent)
            if not open_passes or i == len(caches) - 1:
                join_layer(md)
        assert md.side == [] and md.keep == []
        return outs

    graphed = [c for c, *_ in layers]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compiles outside the capture, as vLLM's warm-up does
        step([_clone(c) for c in graphed], True, False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs_g = step(graphed, True, True)
    graph.replay()
    outs_e = step(eager, False, False)
    torch.cuda.synchronize()
    for a, b in zip(outs_g, outs_e, strict=True):
        assert torch.equal(a, b)
    for cg, ce, (kg, ke) in zip(graphed, eager, ks, strict=True):
        assert torch.equal(kg, ke)
        for f in FIELDS:
            assert torch.equal(getattr(cg, f), getattr(ce, f)), f


def _clone(cache: PagedKVCache) -> PagedKVCache:
    c = allocate_cache(LO, 12, 4, DEVICE)
    for f in FIELDS:
        getattr(c, f).copy_(getattr(cache, f))
    return c


def test_only_a_window_pass_asked_to_lets_its_dependents_start_at_once(monkeypatch):
    """``plan_write(trigger=True)`` (run_layer's ``overlap_rotation``): only a window pass, and only
    where PDL exists, launches with ``TRIGGER`` — a pass with INT2 rows would let the query rotation
    start before the rows it must not race with, and no device without PDL has the instruction."""
    import importlib

    from oscar_kernels import plan_write

    da = importlib.import_module("oscar_kernels.decode_attention")  # the module (the package exports the op)

    cache, params, _, _ = _case(1)
    monkeypatch.setattr(da, "pdl_available", lambda device, tuning=None: True)
    assert plan_write(cache, params, 3, "window", "triton", trigger=True).trigger
    assert not plan_write(cache, params, 3, "window", "triton").trigger
    for parts in ("all", "codes", "pages", "ring"):
        assert not plan_write(cache, params, 3, parts, "triton", trigger=True).trigger, parts
    monkeypatch.setattr(da, "pdl_available", lambda device, tuning=None: False)
    assert not plan_write(cache, params, 3, "window", "triton", trigger=True).trigger
