"""The start-up warm-up (oscar_vllm.warmup): after it, serving launches no kernel specialisation
that it did not launch, so Triton compiles nothing during requests.

Checked by recording every launch's compile key (``oscar_kernels.launch.record_launches``: what
Triton compiles per) through the warm-up and through an engine-like random schedule on the same
layout, on the CPU under Triton's interpreter and, where there is one, on the GPU (where the decode
kernel is the Gluon one and its split count follows the batch size).
"""

from __future__ import annotations

import functools
import json
import random
import types

import pytest
import torch
from conftest import fresh_process_ran

from oscar_kernels.serving import plan_step, plan_window_records, run_layer, write_window_pages
from oscar_vllm.warmup import run_warmup, warmup_steps

PAGE, RECENT, MAX_TOKENS, MAX_SEQS, WIDTH = 16, 16, 80, 5, 8
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")),
]


def _layer(device: str, num_pages: int):
    """A layer as the backend has it: layout, pages viewed from one buffer, window pages, params
    with error feedback (head dim 32 on the CPU, 64 on a GPU: its smallest)."""
    from oscar_kernels import CacheLayout, LayerQuantParams, cache_from_page_buffer, page_bytes
    from oscar_kernels.serving import WindowPages

    d = 32 if device == "cpu" else 64
    lo = CacheLayout(2, d, page_size=PAGE, group_size=16, sink_tokens=8, recent_tokens=RECENT)
    g = torch.Generator().manual_seed(1)
    rk, rv = (torch.linalg.qr(torch.randn(d, d, generator=g))[0] for _ in range(2))
    fb = torch.tril(0.05 * torch.randn(2, d, d, generator=g), -1)
    params = LayerQuantParams(
        rk, rv, 0.3 * torch.randn(2, d, generator=g), 0.9, 0.9, k_feedback=fb, v_feedback=fb.clone()
    ).expand(2, d, device)
    buf = torch.zeros(num_pages, page_bytes(lo), dtype=torch.uint8, device=device)  # launches, not values
    cache = cache_from_page_buffer(lo, buf, MAX_SEQS)
    rows_per_page = page_bytes(lo) // (2 * d)
    plan = plan_window_records(2, PAGE, 8, RECENT, rows_per_page, in_flight_tokens=MAX_TOKENS, min_block=8)
    pages = WindowPages(buf.view(torch.bfloat16).view(num_pages, rows_per_page, d), 2, plan, 8)
    return cache, params, plan, pages


def _window_width(plan) -> int:
    """Columns of a window group's block table: window blocks of the longest row."""
    return -(-WIDTH * PAGE // plan.block_size)


def _served(cache, params, pages, plan, device: str, seed: int, backend: str) -> None:
    """An engine-like schedule: random batches of prefills, chunks over cached tokens, mixed rows
    and decodes, within the engine's limits (tokens per step, rows per step, table width)."""
    rng = random.Random(seed)
    page = cache.layout.page_size
    for _ in range(12):
        b = rng.randint(1, MAX_SEQS)
        budget, rows = MAX_TOKENS, []
        for _ in range(b):
            u = rng.random()  # decodes, short chunks (a prefix hit's tail), any chunk
            n = 1 if u < 0.4 else rng.randint(2, 16) if u < 0.7 else rng.randint(1, max(1, budget))
            n = min(n, budget - (b - len(rows) - 1))
            p = rng.randint(0, WIDTH * page - n - 1)
            rows.append((p, max(n, 1)))
            budget -= max(n, 1)
        qlens = torch.tensor([n for _, n in rows], dtype=torch.int32)
        qsl = torch.zeros(b + 1, dtype=torch.int32)
        qsl[1:] = torch.cumsum(qlens, 0)
        seq = torch.tensor([p + n for p, n in rows], dtype=torch.int32)
        table = torch.randint(1, cache.k_codes.shape[0], (b, WIDTH), dtype=torch.int32)
        mapping = torch.cat(
            [
                table[i, torch.arange(p, p + n) // page].long() * page + torch.arange(p, p + n) % page
                for i, (p, n) in enumerate(rows)
            ]
        )
        slots = torch.tensor(rng.sample(range(MAX_SEQS), b), dtype=torch.int32)
        md = plan_step(
            qsl.to(device), qsl, seq.to(device), seq, table.to(device), mapping.to(device), b, slots, None
        )
        t = md.num_actual_tokens
        d = cache.layout.head_dim
        q = torch.randn(t, 4, d, device=device).to(torch.bfloat16)
        k = torch.randn(t, 2, d, device=device).to(torch.bfloat16)
        v = torch.randn(t, 2, d, device=device).to(torch.bfloat16)
        for _ in range(2):  # a step's first layer plans its launches, a later one runs them
            run_layer(md, cache, params, q, k, v, d**-0.5, backend, out=torch.empty_like(q))
        wt = torch.randint(
            1, cache.k_codes.shape[0], (plan.groups, b, _window_width(plan)), dtype=torch.int32
        )
        write_window_pages(cache, params, k, v, md, pages, wt.to(device), backend)


@pytest.mark.parametrize("device", DEVICES)
def test_after_the_warm_up_serving_compiles_nothing(device, request, monkeypatch):
    if device == "cpu":
        if fresh_process_ran(request, interpret_on_gpu=True):
            return
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from oscar_kernels.launch import record_launches

    backend = "triton" if device == "cpu" else "auto"  # auto: the engines' choice on a GPU
    cache, params, plan, pages = _layer(device, 64)
    steps = warmup_steps(PAGE, RECENT, MAX_TOKENS, MAX_SEQS, WIDTH * PAGE, dense_min_query=None)
    took: dict = {}
    with record_launches() as warm:
        ran = run_warmup(
            cache, params, 4, 0.125, steps, WIDTH, plan, _window_width(plan), backend=backend,
            seconds=took, compile_workers=4,
        )  # fmt: skip
    assert 0 < len(ran) < len(steps)  # steps that launch nothing new run dry only
    # on a GPU every new kernel compiled side by side before the real steps (none under the
    # interpreter); the real steps then launch what was compiled (checked below: nothing missing)
    assert took["kernels"] == (len(warm) if device == "cuda" else 0), (took, len(warm))
    # what vLLM's monitor saw compiled during requests (rotations run in torch on a CPU), and the
    # write of K and V in one launch (decode steps)
    names = {"paged_write_kernel", "paged_write_kv_kernel", "window_records_kernel"} | (
        {"rotate_tiles_kernel"} if device == "cuda" else set()
    )
    assert {k[0] for k in warm} >= names
    with record_launches() as served:
        _served(cache, params, pages, plan, device, 0, backend)
    missing = served - warm
    assert not missing, (
        f"{len(missing)} launches the warm-up did not compile, e.g. {sorted(map(str, missing))[:3]}"
    )

    # ... and the check can fail: a warm-up without the long chunks (the scratch rings of their
    # window rows, the write's largest tiles) leaves compiles to the first long prompts
    short = [s for s in steps if sum(n for _, n in s) <= RECENT]
    with record_launches() as partial:
        run_warmup(cache, params, 4, 0.125, short, WIDTH, plan, _window_width(plan), backend=backend)
    assert served - partial


def test_warmup_steps_stay_within_the_engines_limits():
    steps = warmup_steps(64, 128, 8192, 256, 40960)
    assert all(1 <= len(s) <= 256 for s in steps)
    assert all(sum(n for _, n in s) <= 8192 and all(p + n <= 40960 for p, n in s) for s in steps)
    assert {len(s) for s in steps} == set(range(1, 257))  # every decode batch size
    # every scratch ring a chunk of up to 8192 tokens can need, once
    from oscar_kernels.serving import scratch_ring

    longest = {scratch_ring(max(n for _, n in s)) for s in steps if max(n for _, n in s) > 128}
    assert longest == {scratch_ring(n) for n in range(129, 8193)}
    # a table narrower than the step budget bounds the prefills
    assert max(p + n for s in warmup_steps(64, 128, 8192, 4, 1024) for p, n in s) <= 1024
    # the dense prefill's step has far rows (keys older than the ring) for short and long rings
    for recent in (128, 256, 1024):
        dense = [
            p + n - recent for s in warmup_steps(64, recent, 8192, 4, 40960) for p, n in s if n == 128 and p
        ]
        assert dense and all(far > 0 for far in dense), (recent, dense)


def test_the_warm_up_runs_after_vllms_own_once_per_hook():
    """compat.after_model_warm_up on a stand-in for vLLM's GPU worker: the hook runs after the
    worker's warm-up and capture, with the worker, once per call however often it is installed."""
    from oscar_vllm import compat

    calls = []

    class Worker:
        def compile_or_warm_up_model(self):
            calls.append("vllm")
            return "times"

    def hook(worker):
        calls.append(("oscar", type(worker).__name__))

    assert compat.after_model_warm_up(hook, Worker) and compat.after_model_warm_up(hook, Worker)
    assert Worker().compile_or_warm_up_model() == "times"
    assert calls == ["vllm", ("oscar", "Worker")]


def test_the_warm_up_runs_before_vllms_jit_monitor_starts():
    """Where the worker starts vLLM's JIT monitor (0.33) the warm-up runs just before it: its
    compiles are warm-up, and the monitor's warnings name only compiles during requests."""
    from oscar_vllm import compat

    calls = []

    class Worker:
        def compile_or_warm_up_model(self):
            calls.append("capture")
            self._maybe_activate_jit_monitor()
            calls.append("gc freeze")

        def _maybe_activate_jit_monitor(self):
            calls.append("monitor")

    assert compat.after_model_warm_up(lambda w: calls.append("oscar"), Worker)
    Worker().compile_or_warm_up_model()
    assert calls == ["capture", "oscar", "monitor", "gc freeze"]


def test_the_kernels_compile_ahead_once_the_profiling_kv_cache_exists():
    """compat.after_profiling_kv_cache on a stand-in for vLLM's GPU model runner: the hook runs
    right after the runner allocated its CUDA-graph memory profile's KV cache (before that
    profile captures), with the runner, once however often installed; False where the runner has
    no such method (nothing hooked)."""
    from oscar_vllm import compat

    calls = []

    class Runner:
        def _init_minimal_kv_cache_for_profiling(self):
            calls.append("kv cache")

        def profile_cudagraph_memory(self):
            self._init_minimal_kv_cache_for_profiling()
            calls.append("captures")

    def hook(runner):
        calls.append(("oscar", type(runner).__name__))

    none = types.ModuleType("no_v2_runner")  # (the real V2 module is left alone here)
    assert compat.after_profiling_kv_cache(hook, Runner, none)
    assert compat.after_profiling_kv_cache(hook, Runner, none)
    Runner().profile_cudagraph_memory()
    assert calls == ["kv cache", ("oscar", "Runner"), "captures"]
    assert not compat.after_profiling_kv_cache(hook, type("Older", (), {}), none)


def test_the_kernels_compile_ahead_under_the_v2_runner_too():
    """vLLM 0.33's V2 runner profiles through module functions (``vllm/v1/worker/gpu/
    cudagraph_utils.py``: ``profile_cudagraph_memory(runner)`` calls ``_init_minimal_kv_cache_for_
    profiling(runner)`` by name): the hook runs after the latter, with the runner, once however
    often installed. (On the H100 the V1 hook alone left the profile's captures compiling.)"""
    from oscar_vllm import compat

    calls = []
    v2 = types.ModuleType("v2_cudagraph_utils")
    exec(  # functions whose globals are the module's, as vLLM's are
        "def _init_minimal_kv_cache_for_profiling(runner):\n"
        "    calls.append('kv cache')\n"
        "def profile_cudagraph_memory(runner):\n"
        "    _init_minimal_kv_cache_for_profiling(runner)\n"
        "    calls.append('captures')\n",
        v2.__dict__,
    )
    v2.calls = calls

    class Runner:
        pass

    def hook(runner):
        calls.append(("oscar", type(runner).__name__))

    no_v1 = type("NoV1", (), {})
    assert compat.after_profiling_kv_cache(hook, no_v1, v2)
    assert compat.after_profiling_kv_cache(hook, no_v1, v2)
    v2.profile_cudagraph_memory(Runner())
    assert calls == ["kv cache", ("oscar", "Runner"), "captures"]


def test_the_warm_up_follows_vllms_jit_warm_up_unless_told(monkeypatch):
    """Default: on where vLLM warms its own kernels (graphs), off with ``enforce_eager``;
    ``OSCAR_VLLM_WARMUP`` 1 / 0 overrides; another value is one clear error."""
    from types import SimpleNamespace as NS

    from oscar_math.errors import OscarError
    from oscar_vllm.warmup import warmup_wanted

    graphs = NS(kernel_config=NS(enable_jit_warmup=True), model_config=NS(enforce_eager=False))
    eager = NS(kernel_config=NS(enable_jit_warmup=False), model_config=NS(enforce_eager=True))
    older = NS(model_config=NS(enforce_eager=True))  # no kernel_config: follow enforce_eager
    monkeypatch.delenv("OSCAR_VLLM_WARMUP", raising=False)
    assert warmup_wanted(graphs) and not warmup_wanted(eager) and not warmup_wanted(older)
    monkeypatch.setenv("OSCAR_VLLM_WARMUP", "1")
    assert warmup_wanted(eager)
    monkeypatch.setenv("OSCAR_VLLM_WARMUP", "0")
    assert not warmup_wanted(graphs)
    monkeypatch.setenv("OSCAR_VLLM_WARMUP", "yes")
    with pytest.raises(OscarError, match="OSCAR_VLLM_WARMUP"):
        warmup_wanted(graphs)


def test_with_split_tails_the_warm_up_meets_every_split_count(monkeypatch):
    """With short chunks split over long prefixes (``extend_splits="auto"``) the extend kernel's
    rows (:func:`oscar_kernels.extend_block_m`) and split count are constexprs picked from the
    longest chunk, the grid size and the longest context: the warm-up's steps give every pair an
    engine can meet (Qwen3-8B's 8 KV heads of GQA 4, 132 SMs, vLLM's 131k-token table, chunks
    below the dense prefill's 128 tokens)."""
    import importlib

    ea = importlib.import_module("oscar_kernels.extend_attention")  # the module, not the function
    monkeypatch.setattr(ea, "_num_sms", lambda device: 132)
    hkv, g, max_len, max_seqs, max_tokens = 8, 4, 131072, 127, 8192
    dev = torch.device("cpu")

    def key(max_q: int, b: int, seq: int) -> tuple[int, int]:
        rows = ea.extend_block_m(max_q, g)
        programs = -(-max_q // (rows // g)) * b * hkv
        return rows, ea.choose_extend_splits(programs, seq, 64, dev)

    def keys(steps) -> set:
        return {
            key(max(n for _, n in s), len(s), max(p + n for p, n in s))
            for s in steps
            if not all(n == 1 for _, n in s) and max(n for _, n in s) < 128  # the Triton extends
        }

    steps = warmup_steps(64, 128, max_tokens, max_seqs, max_len, split_tails=True)
    warm = keys(steps)
    grids = {
        (ea.extend_block_m(q, g), -(-q // (ea.extend_block_m(q, g) // g)) * b * hkv)
        for q in range(2, 128)
        for b in range(1, max_seqs + 1)
        if q + b - 1 <= max_tokens
    }
    engine = {
        (rows, ea.choose_extend_splits(programs, seq, 64, dev))
        for rows, programs in grids
        for seq in range(2, max_len + 1, 61)
    }
    assert engine <= warm, sorted(engine - warm)
    assert max(sp for _, sp in engine) > 1 and len({r for r, _ in engine}) == 3  # splits; 16/32/64 rows
    assert all(sum(n for _, n in s) <= max_tokens and all(p + n <= max_len for p, n in s) for s in steps)
    plain = warmup_steps(64, 128, max_tokens, max_seqs, max_len)
    assert keys(plain) < warm  # the tails add them


def _worker(cache, params, plan, max_seqs: int = 2, max_tokens: int = 40):
    """A stand-in for vLLM's GPU worker with one OSCAR layer (what ``warmup._warm_up`` reads; a
    small configuration: each warm-up here runs Triton's interpreter)."""
    from types import SimpleNamespace as NS

    impl = NS(oscar_layer=True, _layer_state=lambda layer, kv: (cache, params), _plan=plan,
              window_names=["w0"], num_heads=4, scale=0.125, max_seqs=max_seqs, _dense=None,
              _splits=1, _overlap=True, _overlap_layers=False, _overlap_rotation=False)  # fmt: skip
    layer = NS(impl=impl, kv_cache=[torch.zeros(1, dtype=torch.uint8)])
    cfg = NS(
        scheduler_config=NS(max_num_batched_tokens=max_tokens),
        model_config=NS(max_model_len=WIDTH * PAGE),
        compilation_config=NS(static_forward_context={"layers.0.attn": layer}),
    )
    return NS(vllm_config=cfg, model_runner=None)


def test_a_start_like_an_earlier_one_runs_its_chosen_steps_without_dry_runs(
    tmp_path, request, monkeypatch, caplog
):
    """The second start with the same configuration, sources and environment runs only the steps the
    first ran for real (no dry runs: most of a warm start's warm-up), and launches every compile key
    the first launched."""
    if fresh_process_ran(request, interpret_on_gpu=True):
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import oscar_vllm.warmup as wu
    from oscar_kernels.launch import record_launches

    cache, params, plan, _ = _layer("cpu", 64)
    metadata = []
    real = wu._step_metadata
    monkeypatch.setattr(wu, "_step_metadata", lambda *a: metadata.append(a[0]) or real(*a))
    # the interpreter's kernels (on a CPU the engine's "auto" runs the torch references: no launches)
    monkeypatch.setattr(wu, "run_warmup", functools.partial(run_warmup, backend="triton"))
    plans = wu.WarmupPlans(tmp_path)

    with record_launches() as first:
        wu._warm_up(_worker(cache, params, plan), plans)
    saved = list(tmp_path.glob("*.json"))
    assert len(saved) == 1
    steps = warmup_steps(PAGE, RECENT, 40, 2, WIDTH * PAGE, dense_min_query=None)
    chosen = json.loads(saved[0].read_text())["ran"]
    assert len(metadata) == len(steps) and 0 < len(chosen[0]) < len(steps)

    metadata.clear()
    with record_launches() as second, caplog.at_level("INFO", logger="oscar_vllm"):
        wu._warm_up(_worker(cache, params, plan), plans)
    assert metadata == [steps[i] for i in chosen[0]]  # no dry runs
    assert second == first
    line = next(r.getMessage() for r in caplog.records if "warmed up" in r.getMessage())
    assert "the steps an earlier start chose" in line and "dry runs 0.0 s" in line


def test_compiling_ahead_runs_only_dry_and_leaves_the_warm_up_its_steps(tmp_path, request, monkeypatch):
    """``_warm_up(..., compile_only=True)`` (before vLLM's graph profile): every step dry, none for
    real, no plan kept; the warm-up after it still runs its chosen steps for real and keeps its
    plan. A start whose plan is known compiles nothing ahead (Triton's disk cache has the kernels)."""
    if fresh_process_ran(request, interpret_on_gpu=True):
        return
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import oscar_vllm.warmup as wu
    from oscar_kernels.launch import record_launches

    cache, params, plan, _ = _layer("cpu", 64)
    took: list[dict] = []

    def spy(*a, **kw):  # the interpreter's kernels; each call's host seconds kept
        kw["seconds"] = {}
        took.append(kw)
        return run_warmup(*a, **dict(kw, backend="triton"))

    monkeypatch.setattr(wu, "run_warmup", spy)
    plans = wu.WarmupPlans(tmp_path)
    with record_launches() as ahead:  # dry launches are recorded too
        wu._warm_up(_worker(cache, params, plan), plans, compile_only=True)
    assert [kw["compile_only"] for kw in took] == [True] and ahead and not list(tmp_path.glob("*.json"))
    # dry runs took time, real steps none (real steps under the interpreter take much longer)
    assert took[0]["seconds"]["dry"] > 0 and took[0]["seconds"]["real"] < 1e-3, took[0]["seconds"]
    took.clear()
    wu._warm_up(_worker(cache, params, plan), plans)
    assert len(list(tmp_path.glob("*.json"))) == 1 and took[0]["seconds"]["real"] > 0.02, took[0]["seconds"]
    called = []
    monkeypatch.setattr(wu, "run_warmup", lambda *a, **kw: called.append(kw))
    wu._warm_up(_worker(cache, params, plan), plans, compile_only=True)
    assert called == []
    with pytest.raises(ValueError, match="compile_only"):
        run_warmup(cache, params, 4, 0.125, [((0, 2),)], WIDTH, only=[0], compile_only=True)


def test_a_warm_up_plan_that_does_not_fit_is_not_used(tmp_path, monkeypatch):
    """A saved plan is used only under its own key (the configurations and steps, the environment
    that picks kernels) and only if it is whole and fits the steps (a count per configuration,
    indices in range); anything else, a garbage file included, reads as none."""
    from oscar_vllm.warmup_plans import WarmupPlans

    plans = WarmupPlans(tmp_path)
    cpu = torch.device("cpu")
    key = plans.key(cpu, [("config", [((0, 2),), ((0, 3),)])])
    assert plans.load(key, [2]) is None  # nothing saved
    plans.save(key, [[0, 1]])
    assert plans.load(key, [2]) == [[0, 1]]
    assert plans.load(key, [1]) is None  # index out of range
    assert plans.load(key, [2, 2]) is None  # another number of configurations
    assert not list(tmp_path.glob(".*.tmp"))  # written whole, then renamed
    assert key != plans.key(cpu, [("config", [((0, 2),)])])  # other steps
    assert key != plans.key(cpu, [("other config", [((0, 2),), ((0, 3),)])])
    monkeypatch.setenv("OSCAR_GLUON_DECODE", "0")  # the environment picks kernels
    assert key != plans.key(cpu, [("config", [((0, 2),), ((0, 3),)])])
    monkeypatch.delenv("OSCAR_GLUON_DECODE")
    assert key == plans.key(cpu, [("config", [((0, 2),), ((0, 3),)])])
    (tmp_path / f"{key}.json").write_text("{not json")
    assert plans.load(key, [2]) is None
    (tmp_path / f"{key}.json").write_text('{"ran": [["0"]]}')
    assert plans.load(key, [2]) is None
