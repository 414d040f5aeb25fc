"""The backend's per-step logic without vLLM: window slots, metadata, and the GPU check script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from conftest import fresh_process_ran

from oscar_kernels.serving import FreshRows, RequestSlots, WindowSlots, plan_step, run_layer
from oscar_math.errors import OscarError


def test_window_slots_follow_requests_by_first_block():
    s = WindowSlots(2)
    a, b = s.assign([7, 9], [True, True], [True, True])
    assert {a, b} == {0, 1}
    assert s.assign([9, 7], [False, False], [True, True]) == [b, a]  # continuing rows keep their slot
    # a continuing request this worker never saw (a prefix-cache hit) is refused, not served garbage
    with pytest.raises(OscarError, match="prefix-cache hit"):
        s.assign([11], [False], [True])
    # a new request while both slots are taken evicts the one not in this batch
    assert s.assign([7, 12], [False, True], [True, True]) == [a, b]
    # a restart on a reused first block takes that slot again; padding rows get 0
    assert s.assign([12, 0], [True, False], [True, False]) == [b, 0]
    with pytest.raises(OscarError, match="more than 2 live requests"):
        s.assign([7, 12, 13], [False, False, True], [True, True, True])


def test_request_slots_keep_a_skipped_requests_slot_until_it_ends():
    s = RequestSlots(3)
    assert s.rows_for(0) is None  # outside a step (dummy and capture runs): no rows
    assert s.step(set(), ["a", "b", "c"]) == [0, 1, 2]
    assert s.rows_for(3) == [0, 1, 2] and s.rows_for(2) is None  # a dummy batch of another size
    assert s.rows_for(5) == [0, 1, 2, 0, 0]  # a batch padded for a CUDA graph: padding rows slot 0
    # "b" skipped while "a" finished and "d" arrived: "d" takes a's slot, never b's
    assert s.step({"a"}, ["c", "d"]) == [2, 0]
    # however long "b" is skipped, it comes back to its own slot (its windows are still there)
    assert s.step(set(), ["d", "c"]) == [0, 2]
    assert s.step(set(), ["b", "d", "c"]) == [1, 0, 2]
    # preempted / resumed ids end like finished ones; the slot free the longest goes first
    assert s.step({"c", "b"}, ["e", "b"]) == [1, 2]
    s.end_step()
    assert s.rows_for(2) is None
    with pytest.raises(OscarError, match="more than 3 running requests"):
        s.step(set(), ["b", "d", "e", "f"])


def test_the_v1_runner_hook_feeds_request_slots_from_scheduler_outputs(monkeypatch):
    """compat.track_v1_requests on a stand-in for vLLM's V1 runner class: the rows are the
    persistent batch's order after ``_update_states``; finished, preempted and resumed ids end
    their slots; rows exist only inside ``execute_model``; other engines' runners are untouched."""
    from types import SimpleNamespace

    from oscar_vllm import compat

    class Runner:
        def __init__(self, cfg):
            self.vllm_config, self.input_batch, self.seen = cfg, SimpleNamespace(req_ids=[]), []

        def _update_states(self, so):
            self.input_batch.req_ids = list(so.order)

        def execute_model(self, so):
            self._update_states(so)
            self.seen.append(slots.rows)
            return "ran"

    def out(order, finished=(), preempted=None, resumed=()):
        cached = SimpleNamespace(resumed_req_ids=set(resumed))
        return SimpleNamespace(order=order, finished_req_ids=set(finished), preempted_req_ids=preempted,
                               scheduled_cached_reqs=cached)  # fmt: skip

    monkeypatch.setattr(compat, "_v1_runner_class", lambda: Runner)
    monkeypatch.setattr(compat, "_V1_SLOTS", [None, None])
    cfg, slots = object(), RequestSlots(2)
    assert compat.track_v1_requests() is True  # the check alone patches nothing
    assert not getattr(Runner._update_states, "_oscar_rows", False)
    assert compat.track_v1_requests(slots, cfg) and compat.track_v1_requests(slots, cfg)  # idempotent
    r = Runner(cfg)
    assert r.execute_model(out(["x", "y"])) == "ran" and r.seen == [[0, 1]]
    assert slots.rows is None  # cleared after the step
    r.execute_model(out(["y"]))  # "x" skipped: keeps slot 0
    r.execute_model(out(["z", "y"], finished={"x"}))
    r.execute_model(out(["w", "z"], preempted={"y"}))
    r.execute_model(out(["z", "w"], resumed={"z"}))  # a resumed request starts over
    assert r.seen[1:] == [[1], [0, 1], [1, 0], [0, 1]]
    other = Runner(object())  # another engine's runner in this process: left alone
    other.execute_model(out(["a", "b"]))
    assert other.seen == [None]
    assert compat.track_v1_requests() is True
    monkeypatch.setattr(compat, "_v1_runner_class", lambda: None)
    assert compat.track_v1_requests(slots, cfg) is False  # no hook: the caller falls back


def _batch(*rows):
    """``(query_start_loc_cpu, seq_lens_cpu)`` of rows given as ``(query_len, seq_len)``."""
    qsl = [0]
    for q, _ in rows:
        qsl.append(qsl[-1] + q)
    return torch.tensor(qsl), torch.tensor([n for _, n in rows])


def test_fresh_rows_restore_exactly_at_a_requests_first_step_with_cached_tokens():
    gen: dict[int, int] = {}
    f = FreshRows(gen)
    # slot 3: a new request, no cached tokens; slot 5: a prefix hit of 64 tokens (its first step)
    gen.update({3: 1, 5: 1})
    qsl, seq = _batch((10, 10), (30, 94))
    assert f.plan(qsl, seq, [3, 5], 2) == ([3, 5], [(1, 5, 64)])
    # the same requests decode: their slots hold their windows, nothing to restore
    qsl, seq = _batch((1, 11), (1, 95), (0, 0))  # a padding row (no tokens) gets slot 0
    assert f.plan(qsl, seq, [3, 5, 7], 3) == ([3, 5, 0], [])
    # slot 3 is given to another request (a hit of 128 tokens), slot 5's request keeps decoding
    gen[3] += 1
    qsl, seq = _batch((1, 96), (4, 132))
    assert f.plan(qsl, seq, [5, 3], 2) == ([5, 3], [(1, 3, 128)])
    # a resumed request recomputed from scratch (no cached tokens): a fresh slot, no restore
    gen[5] += 1
    qsl, seq = _batch(
        (96, 96),
    )
    assert f.plan(qsl, seq, [5], 1) == ([5], [])
    # a slot the hook never counted (first sight): restored when it has cached tokens
    qsl, seq = _batch(
        (1, 40),
    )
    assert f.plan(qsl, seq, [9], 1) == ([9], [(0, 9, 39)])
    assert f.plan(qsl, seq, [9], 1) == ([9], [])


def test_request_slots_count_the_requests_each_slot_was_given():
    s = RequestSlots(2)
    s.step(set(), ["a", "b"])
    s.step(set(), ["a", "b"])  # the same requests: no new generation
    assert s.generation == {0: 1, 1: 1}
    s.step({"a"}, ["b", "c"])  # "c" takes a's slot
    s.step({"c"}, ["c"])  # preempted and resumed in one step: a new request again
    assert s.generation == {0: 3, 1: 1}


def test_the_v2_runner_hook_counts_the_requests_each_row_was_given(monkeypatch):
    """compat.track_v2_rows on a stand-in for vLLM's V2 runner class: a row's count goes up when
    it gets a request other than the one it held (new, or resumed after preemption), not when a
    request is re-added to its own row (streaming input); other engines' runners are untouched."""
    from types import SimpleNamespace

    from oscar_vllm import compat

    class Runner:
        def __init__(self, cfg):
            self.vllm_config = cfg
            self.req_states = SimpleNamespace(req_id_to_index={})
            self.free = [0, 1, 2]

        def finish_requests(self, so):
            for rid in (*so.finished_req_ids, *(so.preempted_req_ids or ())):
                row = self.req_states.req_id_to_index.pop(rid, None)
                if row is not None:
                    self.free.insert(0, row)

        def add_requests(self, so):
            for new in so.scheduled_new_reqs:
                old = self.req_states.req_id_to_index.pop(new.req_id, None)  # a streaming update
                if old is not None:
                    self.free.insert(0, old)
                self.req_states.req_id_to_index[new.req_id] = self.free.pop(0)

        def step(self, new=(), finished=(), preempted=()):
            so = SimpleNamespace(
                scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new],
                finished_req_ids=set(finished),
                preempted_req_ids=set(preempted),
            )
            self.finish_requests(so)
            self.add_requests(so)

    monkeypatch.setattr(compat, "_V2_ROWS", [None, None, None])
    cfg = object()
    gen = compat.track_v2_rows(cfg, Runner)
    assert compat.track_v2_rows(cfg, Runner) is gen  # idempotent: wrapped once, one count
    r = Runner(cfg)
    r.step(new=["a", "b"])
    assert gen == {0: 1, 1: 1}
    r.step(new=["b"])  # "b" re-added to its own row (streaming input): its windows are there
    assert gen == {0: 1, 1: 1}
    r.step(new=["c"], finished=["a"])  # "c" takes a's row
    assert gen == {0: 2, 1: 1}
    r.step(new=["b"], preempted=["b"])  # preempted and resumed into the same row: starts over
    assert gen == {0: 2, 1: 2}
    other = Runner(object())  # another engine's runner in this process: left alone
    other.step(new=["x"])
    assert gen == {0: 2, 1: 2}


def test_plan_step_positions_and_decode_detection():
    qsl = torch.tensor([0, 1, 4, 5], dtype=torch.int32)  # decode, 3-token chunk, decode
    seq = torch.tensor([10, 7, 3], dtype=torch.int32)
    table = torch.tensor([[5, 6], [8, 0], [9, 0]], dtype=torch.int32)
    slot = torch.tensor([1, 2, 3, 4, 5, -1, -1])
    md = plan_step(qsl, qsl, seq, seq, table, slot, 3, torch.tensor([2, 0, 1]), None)
    assert md.num_actual_tokens == 5 and md.max_query_len == 3 and not md.all_decode
    assert md.positions.tolist() == [9, 4, 5, 6, 2]
    assert md.seq_index.tolist() == [0, 1, 1, 1, 2]
    assert md.prefix_lens.tolist() == [9, 4, 2]
    assert md.slot_mapping.tolist() == [1, 2, 3, 4, 5]
    assert md.window_slots.tolist() == [2, 0, 1]
    md2 = plan_step(qsl[:2], qsl[:2], seq[:1], seq[:1], table[:1], slot[:1], 1, torch.tensor([3]), None)
    assert md2.all_decode and md2.window_slots.tolist() == [3]
    with pytest.raises(OscarError, match="prefix-cache hit"):  # V1 path: continuing rows never seen
        plan_step(qsl, qsl, seq, seq, table, slot, 3, None, WindowSlots(4))


# ---- a request's outputs depend on its own chunks only -------------------------------------
# (docs/vllm.md, "Reproducibility": vLLM's schedule may differ run to run; nothing else may matter)

_LEN = {0: 50, 1: 30, 2: 40}  # request -> tokens (prompt and decodes alike)


def _data(g: torch.Generator) -> dict[int, tuple[torch.Tensor, ...]]:
    """Each request's q/k/v per position (``H_q = 4``, ``H_kv = 2``, ``d = 32``)."""
    return {
        r: (
            torch.randn(n, 4, 32, generator=g).to(torch.bfloat16),
            (torch.randn(n, 2, 32, generator=g) * 2 + 0.5).to(torch.bfloat16),
            torch.randn(n, 2, 32, generator=g).to(torch.bfloat16),
        )
        for r, n in _LEN.items()
    }


def _serve(
    steps, blocks, slots: WindowSlots, fill: float, data, g: torch.Generator
) -> dict[int, torch.Tensor]:
    """Run ``steps`` (lists of (request, first position, tokens)) through plan_step/run_layer with
    the torch references over a garbage page buffer and windows filled with ``fill``; returns each
    request's outputs by position."""
    from oscar_kernels import CacheLayout, LayerQuantParams, cache_from_page_buffer, page_bytes

    lo = CacheLayout(2, 32, page_size=16, group_size=16, sink_tokens=8, recent_tokens=16)
    pg = torch.Generator().manual_seed(1)  # the same rotations in every run
    rk, rv = (torch.linalg.qr(torch.randn(2, 32, 32, generator=pg))[0] for _ in range(2))
    params = LayerQuantParams(rk, rv, 0.3 * torch.randn(2, 32, generator=pg), 0.9, 0.9).expand(2, 32, "cpu")
    n_pages = 1 + max(max(b) for b in blocks.values())
    buf = torch.randint(0, 256, (n_pages, page_bytes(lo)), dtype=torch.uint8, generator=g)
    cache = cache_from_page_buffer(lo, buf, slots.num_slots)
    for f in ("k_sink", "v_sink", "k_recent", "v_recent"):
        getattr(cache, f).fill_(fill)
    out = {r: torch.full((n, 4, 32), float("nan")) for r, n in _LEN.items()}
    for step in steps:
        qlens = [n for _, _, n in step]
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        seq = torch.tensor([p + n for _, p, n in step], dtype=torch.int32)
        table = torch.tensor([(blocks[r] + [0] * 4)[:4] for r, _, _ in step], dtype=torch.int32)
        mapping = [blocks[r][i // 16] * 16 + i % 16 for r, p, n in step for i in range(p, p + n)]
        slot = torch.tensor([*mapping, -1, -1])  # vLLM pads the token count with -1
        md = plan_step(qsl, qsl, seq, seq, table, slot, len(step), None, slots)
        q, k, v = (torch.cat([data[r][i][p : p + n] for r, p, n in step]) for i in range(3))
        o = run_layer(md, cache, params, q, k, v, 32**-0.5)
        for j, (r, p, n) in enumerate(step):
            out[r][p : p + n] = o[int(qsl[j]) : int(qsl[j + 1])].float()
    return out


def test_outputs_depend_on_a_requests_own_chunks_only(monkeypatch):
    """Same chunks per request -> bitwise the same outputs, whatever the batch order, the other
    rows of a step (a decode row runs the extend path when another row prefills), the KV blocks,
    the window slots and the memory left in pages and windows (NaN: a read of an unwritten
    window row would show)."""
    data = _data(torch.Generator().manual_seed(0))
    # request 0: 20 + 20 + 4 prompt tokens, then decodes; request 1: 16 + 10, then decodes
    alone = [[(0, 0, 20), (1, 0, 16)], [(0, 20, 20), (1, 16, 10)], [(0, 40, 4), (1, 26, 1)]]
    alone += [[(0, 44 + i, 1), (1, 27 + i, 1)] for i in range(3)]  # all-decode steps
    alone += [[(0, 47 + i, 1)] for i in range(3)]
    first = _serve(alone, {0: [1, 2, 3, 4], 1: [5, 6]}, WindowSlots(4), 0.0, data, torch.Generator())
    # the same chunks of requests 0 and 1, with request 2 prefilling beside them (their decode rows
    # then go through the extend path), rows in other orders, other blocks and slots, NaN windows
    mixed = [[(1, 0, 16), (2, 0, 8), (0, 0, 20)], [(0, 20, 20), (2, 8, 10), (1, 16, 10)]]
    mixed += [[(2, 18, 12), (1, 26, 1), (0, 40, 4)], [(1, 27, 1), (0, 44, 1), (2, 30, 5)]]
    mixed += [[(0, 45, 1), (2, 35, 5), (1, 28, 1)], [(1, 29, 1), (0, 46, 1)]]
    mixed += [[(0, 47 + i, 1)] for i in range(3)]
    slots = WindowSlots(4)
    slots.assign([9], [True], [True])  # a finished request holds slot 0
    blocks = {0: [7, 3, 10, 8], 1: [2, 11], 2: [4, 5, 6]}
    second = _serve(mixed, blocks, slots, float("nan"), data, torch.Generator().manual_seed(5))
    for r in (0, 1):
        assert torch.isfinite(first[r]).all()
        assert torch.equal(first[r], second[r]), r
    # ... and the check can fail: window slots by batch row (not by request) read other requests' rows
    monkeypatch.setattr(WindowSlots, "assign", lambda self, blocks, starts, active: list(range(len(blocks))))
    planted = _serve(mixed, blocks, WindowSlots(4), float("nan"), data, torch.Generator().manual_seed(5))
    assert not all(torch.equal(first[r], planted[r]) for r in (0, 1))
    # a request's own chunks do matter (windows are applied per chunk): 50 tokens as 25 + 25
    other = [[(0, 0, 22)], [(0, 22, 22)], *([(0, 44 + i, 1)] for i in range(6))]
    other = _serve(other, {0: [1, 2, 3, 4]}, WindowSlots(4), 0.0, data, torch.Generator())[0]
    diff = float((first[0] - other).abs().max())
    print(f"\nrequest 0, prompt as 20+20+4 vs 22+22 tokens: max |diff| {diff:.2e}")


def _gpu_check_module(monkeypatch, name: str):
    """``benchmarks/gpu_check.py`` imported as module ``name``; the Triton interpreter on CPU
    (skips, with the reason, without Triton)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (pip install 'oscar-kernels[triton]')")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_script_reduced_on_cpu(monkeypatch, request):
    """The script the coordinator runs on the H200, in its reduced form through the Triton interpreter."""
    if fresh_process_ran(request):
        return
    mod = _gpu_check_module(monkeypatch, "oscar_vllm_gpu_check")
    res = mod.run_case(mod.REDUCED[0], torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    assert res["pass"], res
    assert res["steps"] >= 5 and res["attn_rel_err"] < 1e-2
    # the check can fail: the kernels reading another sequence's windows is caught
    from dataclasses import replace

    orig = mod.attend_step

    def wrong_windows(cache, params, q, k, v, md, scale, backend="auto"):
        if backend == "triton":
            md = replace(md, window_slots=(md.window_slots + 1) % cache.max_seqs)
        return orig(cache, params, q, k, v, md, scale, backend)

    monkeypatch.setattr(mod, "attend_step", wrong_windows)
    assert not mod.run_case(mod.REDUCED[0], torch.device("cpu"))["pass"]


def test_gpu_check_graph_case_reduced_on_cpu(monkeypatch, request):
    """The CUDA-graph case of the GPU script, reduced: decode steps padded to the graph's batch
    through the builder's persistent buffers (on CPU an eager call on the buffers stands in for
    the replay), a mixed batch with padding rows and tokens. Planted: metadata handed over in
    fresh tensors instead of the buffers (what a replay would not see) fails it; so do token
    tensors that stop at the last real token (a replay would process stale padding entries)."""
    if fresh_process_ran(request):
        return
    mod = _gpu_check_module(monkeypatch, "oscar_vllm_gpu_check_graph")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    res = mod.run_graph_case(mod.GRAPH_REDUCED[0], dev)
    assert res["pass"], res
    from oscar_kernels.serving import StepBuffers

    hold = StepBuffers.hold
    monkeypatch.setattr(StepBuffers, "hold", lambda self, md: md)
    res = mod.run_graph_case(mod.GRAPH_REDUCED[0], dev)
    assert not res["pass"] and not res["addresses_kept"]
    monkeypatch.setattr(StepBuffers, "hold", hold)
    real = mod.plan_step

    def unpadded(*a, num_tokens=None, **k):
        return real(*a, **k)

    monkeypatch.setattr(mod, "plan_step", unpadded)
    try:
        res = mod.run_graph_case(mod.GRAPH_REDUCED[0], dev)
    except OscarError as e:  # the eager call refuses token tensors shorter than the batch
        assert "slot_mapping" in str(e)
    else:
        assert not res["pass"]


# ---- prefix-cache hits: restored BF16 rows give the outputs of a miss -----------------------
# (docs/vllm.md, "Prefix caching": what the windows-in-pages design needs of the worker)


WB, G = 8, 3  # window blocks of 8 tokens (INT2 blocks of 16); a record spans 3 pages


def _hit_setup():
    from oscar_kernels import CacheLayout, LayerQuantParams, cache_from_page_buffer, page_bytes
    from oscar_kernels.serving import WindowPages, plan_window_records

    lo = CacheLayout(2, 32, page_size=16, group_size=16, sink_tokens=8, recent_tokens=16)
    pg = torch.Generator().manual_seed(1)
    rk, rv = (torch.linalg.qr(torch.randn(2, 32, 32, generator=pg))[0] for _ in range(2))
    params = LayerQuantParams(rk, rv, 0.3 * torch.randn(2, 32, generator=pg), 0.9, 0.9).expand(2, 32, "cpu")
    g = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 256, (96, page_bytes(lo)), dtype=torch.uint8, generator=g)
    cache = cache_from_page_buffer(lo, buf, 4)
    for f in ("k_sink", "v_sink", "k_recent", "v_recent"):
        getattr(cache, f).fill_(float("nan"))  # an unrestored row that is read shows as NaN
    # window records in pages of 20 rows (an engine's: its INT2 page size), NaN until written:
    # window blocks of 8 tokens (held: ceil(15 / 8) = 2 before a position), the sink in 2 parts of
    # 4, so a record is 2 * 2 * (8 + 4) = 48 rows, i.e. 3 pages (window groups)
    plan = plan_window_records(2, 16, 8, 16, 20, in_flight_tokens=24, min_block=8)
    assert (plan.block_size, plan.sink_parts, plan.sink_part, plan.groups) == (WB, 2, 4, G)
    pages = WindowPages(torch.full((128, 20, 32), float("nan"), dtype=torch.bfloat16), 2, plan, 8)
    return cache, params, pages


def _tables(first: int, n_blocks: int) -> list[list[int]]:
    """Window block tables ``[G groups][n_blocks]`` with distinct block ids from ``first``."""
    return [[first + G * j + gi for j in range(n_blocks)] for gi in range(G)]


def _run_hit(state, steps, blocks, wtables, slot, x, restore=None):
    """One request (``blocks``: INT2 blocks, ``wtables``: window tables) through ``steps`` of
    (first position, tokens); ``restore`` = cached tokens to restore into ``slot`` first."""
    from oscar_kernels.serving import restore_windows, write_window_pages

    cache, params, pages = state
    out = torch.full((x[0].shape[0], 4, 32), float("nan"))
    wt = torch.tensor(wtables)
    if restore:
        restore_windows(cache, slot, pages, wt, restore)
    for p, n in steps:
        qsl = torch.tensor([0, n], dtype=torch.int32)
        seq = torch.tensor([p + n], dtype=torch.int32)
        table = torch.tensor([(blocks + [0] * 4)[:4]], dtype=torch.int32)
        mapping = torch.tensor([blocks[i // 16] * 16 + i % 16 for i in range(p, p + n)])
        md = plan_step(qsl, qsl, seq, seq, table, mapping, 1, torch.tensor([slot]), None)
        q, k, v = (t[p : p + n] for t in x)
        o = run_layer(md, cache, params, q, k, v, 32**-0.5)
        write_window_pages(cache, params, k, v, md, pages, wt[:, None, :])
        out[p : p + n] = o.float()
    return out


@pytest.mark.parametrize("n_cached", [16, 32, 48])
def test_a_prefix_hit_with_restored_windows_gives_the_outputs_of_a_miss(n_cached, monkeypatch):
    """Request A: a 40-token prompt (20 + 20) and 10 decoded tokens. Request B: A's first 48 tokens
    (prompt and generated) plus 12 more. B hitting ``n_cached`` of A's tokens (INT2 blocks shared,
    window records of the blocks a sliding-window group keeps shared, a fresh NaN window slot
    restored from them) gives bitwise the outputs of B computed from scratch in other chunks
    (per-token windows: chunking does not matter); 48 hits blocks that hold generated tokens.
    Without the restore, or restoring one row short, it does not."""
    from oscar_kernels.serving import window_pages as step_mod

    g = torch.Generator().manual_seed(0)
    x = (
        torch.randn(60, 4, 32, generator=g).to(torch.bfloat16),
        (torch.randn(60, 2, 32, generator=g) * 2 + 0.5).to(torch.bfloat16),
        torch.randn(60, 2, 32, generator=g).to(torch.bfloat16),
    )
    miss = _run_hit(_hit_setup(), [(0, 24), (24, 24), (48, 12)], [1, 2, 3, 4], _tables(40, 8), 2, x)
    assert torch.isfinite(miss).all()

    def hit(restore=True):
        state = _hit_setup()
        a_steps = [(0, 20), (20, 20), *((40 + i, 1) for i in range(10))]
        a_tables = _tables(60, 8)
        _run_hit(state, a_steps, [9, 10, 11, 12], a_tables, 0, tuple(t[:50] for t in x))
        shared = n_cached // 16
        held = n_cached // WB  # window blocks before the hit
        # B shares A's INT2 blocks of the hit and the window blocks a sliding-window group
        # (window = recent = 16, blocks of 8) keeps for it: the last two before the hit; the
        # others are the null block (0, never written: NaN); new blocks after the hit
        new = _tables(0, 8)
        wt = [
            [a[j] if held - 2 <= j < held else (0 if j < held else nb[j]) for j in range(8)]
            for a, nb in zip(a_tables, new, strict=True)
        ]
        blocks = [9, 10, 11, 12][:shared] + [24, 25, 26, 27][shared:]
        return _run_hit(
            state, [(n_cached, 60 - n_cached)], blocks, wt, 3, x, restore=n_cached if restore else None
        )

    out = hit()
    assert torch.equal(out[n_cached:], miss[n_cached:])
    assert not torch.isfinite(hit(restore=False)[n_cached:]).all()  # the slot's rows are read
    real = step_mod.hit_window_positions
    monkeypatch.setattr(step_mod, "hit_window_positions", lambda n, s, r: real(n, s, r)[:-1])
    planted = hit()
    assert not torch.equal(planted[n_cached:], miss[n_cached:])


# ---- restore only when a slot does not hold a request's windows (SlotTracker) ---------------


def _batched(state, schedule, reqs, x, tracker, fixed=None):
    """Run ``schedule`` (steps of ``[(request, tokens)]``, each step's rows in that order) like the
    backend with prefix caching: the builder's :func:`plan_slots`, the restore of the rows it
    flags, the layer, the window-record write. Returns each request's outputs ``[T, H_q, d]``."""
    from oscar_kernels.serving import plan_slots, restore_window_rows, write_window_pages

    cache, params, pages = state
    done = {r: reqs[r]["start"] for r in reqs}
    out = {r: torch.full((x[r][0].shape[0], 4, 32), float("nan")) for r in reqs}
    for step in schedule:
        b = len(step)
        qlens = [n for _, n in step]
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        seq = torch.tensor([done[r] + n for r, n in step], dtype=torch.int32)
        table = torch.tensor([(reqs[r]["blocks"] + [0] * 4)[:4] for r, _ in step], dtype=torch.int32)
        wt = torch.stack([torch.tensor(reqs[r]["wtables"]) for r, _ in step], dim=1)  # [G, B, 8]
        mapping = torch.tensor(
            [reqs[r]["blocks"][i // 16] * 16 + i % 16 for r, n in step for i in range(done[r], done[r] + n)]
        )
        slots, restore = plan_slots(
            tracker, qsl, seq, table, b, 16, None if fixed is None else [fixed[r] for r, _ in step]
        )
        md = plan_step(qsl, qsl, seq, seq, table, mapping, b, torch.tensor(slots), None)
        restore_window_rows(cache, pages, wt, restore, md.restore_index)  # as the backend: all rows at once
        q, k, v = (torch.cat([x[r][i][done[r] : done[r] + n] for r, n in step]) for i in range(3))
        o = run_layer(md, cache, params, q, k, v, 32**-0.5)
        write_window_pages(cache, params, k, v, md, pages, wt)
        for j, (r, n) in enumerate(step):
            out[r][done[r] : done[r] + n] = o[qsl[j] : qsl[j + 1]].float()
            done[r] += n
    return out


def _requests(n_tokens):
    g = torch.Generator().manual_seed(5)
    x = {
        r: (
            torch.randn(n, 4, 32, generator=g).to(torch.bfloat16),
            (torch.randn(n, 2, 32, generator=g) * 2 + 0.5).to(torch.bfloat16),
            torch.randn(n, 2, 32, generator=g).to(torch.bfloat16),
        )
        for r, n in n_tokens.items()
    }
    reqs = {
        r: {"blocks": [1 + 4 * i + j for j in range(4)], "wtables": _tables(30 + 24 * i, 8), "start": 0}
        for i, r in enumerate(n_tokens)
    }
    return x, reqs


def test_windows_are_restored_exactly_when_a_slot_does_not_hold_them(monkeypatch):
    """Three slots, four requests: rows move between steps (no restore: the slots follow their
    content), requests skipped while others take their slots (least recently used: restored
    on return, from the window records), and vLLM V2's fixed request rows (no restore). Every
    request's outputs are bitwise those it gets alone. Never restoring (a planted bug) fails;
    so does restoring with the wrong prefix."""
    import oscar_kernels.serving as step_mod
    from oscar_kernels.serving import SlotTracker

    x, reqs = _requests({"a": 45, "b": 40, "c": 30, "d": 26})
    schedule = [
        [("a", 20), ("b", 20)],
        [("b", 12), ("a", 20)],  # rows swapped: each keeps its slot
        [("a", 1), ("b", 1), ("c", 16)],
        [("c", 10), ("a", 1)],  # b skipped
        [("d", 20), ("a", 1), ("c", 1)],  # d takes b's slot (the least recently used)
        [("b", 1), ("d", 6), ("a", 1)],  # b returns: restored (into c's slot, least recent)
        [("a", 1), ("b", 6), ("c", 3)],  # c lost its slot to b: restored into d's
    ]
    alone = {}
    for r in reqs:
        own = [[(q, n)] for step in schedule for q, n in step if q == r]
        tracker = SlotTracker(3)
        alone[r] = _batched(_hit_setup(), own, {r: reqs[r]}, {r: x[r]}, tracker)[r]
        assert tracker.restores == 0  # alone: its slot always holds its windows
        assert torch.isfinite(alone[r]).all()

    tracker = SlotTracker(3)
    got = _batched(_hit_setup(), schedule, reqs, x, tracker)
    for r in reqs:
        assert torch.equal(got[r], alone[r]), r
    assert tracker.restores == 2  # b and c, once each; a never (it kept its slot throughout)

    # V2 runner: fixed request rows; a fresh request in a used row restores nothing (no prefix)
    tracker = SlotTracker(4)
    got = _batched(_hit_setup(), schedule, reqs, x, tracker, fixed={"a": 0, "b": 1, "c": 2, "d": 3})
    assert all(torch.equal(got[r], alone[r]) for r in reqs) and tracker.restores == 0

    real = SlotTracker.plan

    def never(self, *a, **k):
        slots, _ = real(self, *a, **k)
        return slots, [False] * len(slots)

    monkeypatch.setattr(SlotTracker, "plan", never)
    planted = _batched(_hit_setup(), schedule, reqs, x, SlotTracker(3))
    assert not torch.equal(planted["b"], alone["b"])
    monkeypatch.undo()
    real_plan = step_mod.plan_slots

    def short(*a, **k):
        slots, restore = real_plan(*a, **k)
        return slots, [(row, slot, p - 1) for row, slot, p in restore]

    monkeypatch.setattr(step_mod, "plan_slots", short)
    planted = _batched(_hit_setup(), schedule, reqs, x, SlotTracker(3))
    assert not torch.equal(planted["b"], alone["b"])


def test_a_slot_whose_block_is_written_through_another_slot_is_forgotten():
    """A slot's key names the INT2 block of its last position; when that block is written through
    another slot (the request finished, its block went to another request), a later request
    with the same block and length must not reuse the stale slot."""
    from oscar_kernels.serving import SlotTracker

    t = SlotTracker(2)
    # request A: 20 tokens in blocks [5, 6] through some slot
    s_a, r = t.plan([-1], [0], [6], [20], [{5, 6}], [True])
    assert r == [False]
    # A is gone; request B got blocks 5, 6 and writes 20 tokens through the other slot
    s_b, _ = t.plan([-1], [0], [6], [20], [{5, 6}], [True])
    assert s_b != s_a  # A's slot is not free (it holds A's content): the free one first
    # B continues: it must get its own slot, not A's (same key (6, 20)), and no restore
    s, r = t.plan([6], [20], [6], [21], [{6}], [True])
    assert s == s_b and r == [False]
    assert t.key[s_a[0]] is None  # A's slot was forgotten when B wrote block 6


def test_a_steps_index_tensors_are_checked_by_its_first_layer_only(monkeypatch):
    """Bounds checks synchronise with the device: the step's first layer runs them (and catches a
    bad table), the step's other layers (same index tensors) skip them."""
    import oscar_kernels._validate as validate
    from oscar_kernels import CacheLayout, LayerQuantParams, cache_from_page_buffer, page_bytes

    seen: list[bool] = []
    real = validate.bounds_checks_enabled
    monkeypatch.setattr(validate, "bounds_checks_enabled", lambda cb=None: seen.append(real(cb)) or seen[-1])
    lo = CacheLayout(2, 32, page_size=16, group_size=16, sink_tokens=8, recent_tokens=16)
    pg = torch.Generator().manual_seed(1)
    rk, rv = (torch.linalg.qr(torch.randn(2, 32, 32, generator=pg))[0] for _ in range(2))
    params = LayerQuantParams(rk, rv, None, 0.9, 0.9).expand(2, 32, "cpu")
    caches = [
        cache_from_page_buffer(
            lo, torch.randint(0, 256, (4, page_bytes(lo)), dtype=torch.uint8, generator=pg), 2
        )
        for _ in range(3)
    ]
    q, k, v = torch.randn(20, 4, 32), torch.randn(20, 2, 32), torch.randn(20, 2, 32)
    qsl = torch.tensor([0, 20], dtype=torch.int32)
    seq = torch.tensor([20], dtype=torch.int32)

    def step(table: list[int]):
        t = torch.tensor([table], dtype=torch.int32)
        slot = torch.tensor([table[i // 16] * 16 + i % 16 for i in range(20)])
        return plan_step(qsl, qsl, seq, seq, t, slot, 1, torch.tensor([0], dtype=torch.int32), None)

    md = step([1, 2])
    run_layer(md, caches[0], params, q, k, v, 32**-0.5)
    first = list(seen)
    assert first and all(first)  # the first layer checked (write pages, attention, write ring)
    for c in caches[1:]:  # the step's other layers run the plan's launches: no checks at all
        run_layer(md, c, params, q, k, v, 32**-0.5)
    assert seen == first
    # a decode step (decode_attention's checks) of the same request: again the first layer only
    seen.clear()
    one = torch.tensor([0, 1], dtype=torch.int32)
    dec = plan_step(
        one, one, seq + 1, seq + 1, torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([2 * 16 + 4]), 1,
        torch.tensor([0], dtype=torch.int32), None,
    )  # fmt: skip
    assert dec.all_decode
    for c in caches:
        run_layer(dec, c, params, q[:1], k[:1], v[:1], 32**-0.5)
    # the first layer's write (its window pass checks; its INT2 pass, the same tensors, asks with
    # the checks off) and attention; the others only launch
    assert seen == [True, False, True]
    bad = step([1, 9])  # page 9 of a 4-page cache: caught by the step's first layer
    with pytest.raises(OscarError):
        run_layer(bad, caches[0], params, q, k, v, 32**-0.5)


def test_scratch_ring_takes_few_sizes_and_holds_every_chunk():
    """An extend step writes its window rows through a scratch ring whose size is a constexpr of
    the write kernel: sized by the chunk length itself, a server compiled the kernel for every new
    chunk length (seconds each on the H200); rounded to powers of two it compiles a handful."""
    from oscar_kernels.serving import scratch_ring

    sizes = {scratch_ring(n) for n in range(1, 20_000)}
    assert len(sizes) <= 12
    assert all(scratch_ring(n) >= n for n in range(1, 20_000))
    assert scratch_ring(257) == 512 and scratch_ring(8192) == 8192
