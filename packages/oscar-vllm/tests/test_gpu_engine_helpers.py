"""benchmarks/gpu_engine.py's host arithmetic (the suite itself runs on a GPU machine only)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def ge():
    sys.path.insert(0, str(BENCH))  # gpu_engine imports stack_sampler from its own folder
    try:
        spec = importlib.util.spec_from_file_location("oscar_gpu_engine", BENCH / "gpu_engine.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def test_the_largest_batch_counts_whole_blocks_per_request(ge):
    # H100, 2026-12-06: FA3 395,712 tokens in 16-token blocks, OSCAR 2,696,629 in 64-token blocks
    assert ge.max_batch(395_712, 100_000, 64, 16, 1024) == 3  # 100,064 tokens = 6,254 blocks each
    assert ge.max_batch(2_696_629, 100_000, 64, 64, 72) == 26  # 100,096 tokens each
    assert ge.max_batch(2_696_629, 100_000, 64, 64, 20) == 20  # the engine's slots cap it
    assert ge.max_batch(1000, 100_000, 64, 16, 8) == 1  # at least one request
    # a request of exactly k blocks fits k blocks, one token more takes another
    assert ge.max_batch(64 * 10, 128, 0, 64, 99) == 5
    assert ge.max_batch(64 * 10, 129, 0, 64, 99) == 3


def test_decode_speed_counts_only_steps_where_the_whole_batch_decodes(ge):
    # 3 requests: a prefill step (no tokens), a step where only the first got one (the others still
    # prefilling), then full steps of 10 ms and 30 ms, then one where a finished request got none
    marks = [(0.0, 0, 0), (1.0, 0, 0), (1.5, 0, 1), (1.51, 1, 4), (1.54, 2, 7), (1.55, 2, 9)]
    marks.insert(5, (1.57, 3, 10))  # a second full step before the one that finished a request
    r = ge.full_batch_rate(marks, 3)
    assert r["full_steps"] == 2  # 1.51 -> 1.54 and 1.54 -> 1.57 (1.5 -> 1.51 prefilled two)
    assert r["decode_tok_s"] == pytest.approx(3 * 2 / 0.06, rel=1e-3)
    assert r["median_step_ms"] == pytest.approx(30.0, abs=0.01)
    assert ge.full_batch_rate(marks[:4], 3) == {}  # no step with all three decoding
    # one request: its prefill step (5 s to the first token) is not a decode step
    r = ge.full_batch_rate([(0.0, 0, 0), (5.0, 1, 1), (5.01, 2, 2), (5.03, 3, 3)], 1)
    assert r["full_steps"] == 2 and r["decode_tok_s"] == pytest.approx(2 / 0.03, rel=1e-3)


def test_maxdecode_generates_through_the_other_requests_prefills(ge):
    # H100, 2026-12-07: OSCAR's 2,696,119 tokens, 64-token blocks, 72 slots; 8,192 prompt tokens a step
    assert ge.maxdecode_tokens(64, 26, 100_000, 8192) == 64 + 318 + 2
    batch, n = ge.maxdecode_plan(2_696_119, 100_000, 64, 64, 72, 8192)
    assert (batch, n) == (26, ge.maxdecode_tokens(64, 26, 100_000, 8192))
    assert batch * (-(-(100_000 + n) // 64) * 64) <= 2_696_119  # the blocks fit at once
    # FA3's 395,712 tokens in 16-token blocks: 3 requests
    assert ge.maxdecode_plan(395_712, 100_000, 64, 16, 1024, 8192)[0] == 3
    # where the extra tokens no longer fit, the batch shrinks until they do
    batch, n = ge.maxdecode_plan(10 * 1000, 900, 10, 100, 99, 100)
    assert batch * (-(-(900 + n) // 100) * 100) <= 10 * 1000
    assert batch < ge.max_batch(10_000, 900, 10, 100, 99)
    # prompts in the prefix cache: the timed pass recomputes at most a block each, one step for all
    # 25 (OSCAR on the H100: 67 tokens each, where generating through all 25 prefills planned 219)
    batch, n = ge.maxdecode_plan(2_538_157, 100_000, 64, 64, 144, 16_384, prefill=64)
    assert (batch, n) == (25, 64 + 1 + 2)
    assert ge.maxdecode_plan(2_538_157, 100_000, 64, 64, 144, 16_384)[1] == 64 + 153 + 2


class _SP:
    def __init__(self, max_tokens: int, **_: object) -> None:
        self.max_tokens = max_tokens


class _Engine:
    """A scheduler in miniature: each step decodes one token for every request past its prefill,
    then prefills waiting prompts in order within ``budget`` tokens (a prompt in the prefix cache
    computes only its last partial block); the step that ends a prompt samples its first token."""

    def __init__(self, budget: int, block: int) -> None:
        self.budget, self.block = budget, block
        self.cached: set[tuple] = set()
        self.reqs: dict = {}  # id -> [prompt, prefill tokens left, tokens out, max tokens]
        self.steps = 0
        sched = type("S", (), {"max_num_batched_tokens": budget})
        self.vllm_config = type("C", (), {"scheduler_config": sched})

    def add_request(self, rid, prompt, sp) -> None:  # noqa: ANN001
        p = tuple(prompt["prompt_token_ids"])
        hit = (len(p) - 1) // self.block * self.block if p in self.cached else 0
        self.reqs[rid] = [p, len(p) - hit, 0, sp.max_tokens]

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def step(self) -> list:
        self.steps += 1
        budget, out = self.budget, []
        for rid, r in list(self.reqs.items()):
            if r[1] == 0:
                r[2] += 1
                budget -= 1
                out.append(rid)
        for rid, r in self.reqs.items():
            if r[1] and budget > 0:
                take = min(r[1], budget)
                r[1] -= take
                budget -= take
                if r[1] == 0:
                    r[2] += 1
                    out.append(rid)
        res = [
            type(
                "O",
                (),
                {"request_id": rid, "outputs": [type("T", (), {"token_ids": [0] * self.reqs[rid][2]})]},
            )
            for rid in out
        ]
        for rid in out:
            r = self.reqs[rid]
            if r[2] >= r[3]:
                self.cached.add(r[0])
                del self.reqs[rid]
        return res


class _LLM:
    def __init__(self, budget: int, block: int) -> None:
        self.llm_engine = _Engine(budget, block)

    def generate(self, prompts, sp, use_tqdm=False) -> list:  # noqa: ANN001, FBT002
        eng, n = self.llm_engine, len(self.llm_engine.reqs)
        for i, p in enumerate(prompts):
            eng.add_request(f"g{eng.steps}-{i}", p, sp)
        got = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                got[o.request_id] = o.outputs[0].token_ids
        assert n == 0, "generate() with requests already running"
        return [type("R", (), {"outputs": [type("T", (), {"token_ids": t})]}) for t in got.values()]


@pytest.mark.parametrize("cached", [True, False])
def test_maxdecode_times_steps_with_the_whole_batch_decoding(ge, monkeypatch, cached):
    """The workload on a miniature engine: prompts of 1,000 tokens, 256 prompt tokens a step. With
    the prefix cache the prompts are prefilled in a first pass and the timed pass decodes all of
    them from its first steps; without, they generate through the others' prefills and the planned
    extra tokens keep the whole batch decoding for the 64 steps too."""
    monkeypatch.setattr(ge, "_gpu_kernels", lambda eng, steps, got: {"steps": steps})  # no profiler
    llm = _LLM(budget=256, block=16)
    res = dict(kv_cache_size_tokens=12 * 1_200, block_size=16, max_num_seqs=64, prefix_caching=cached)
    prompts = lambda n, length, seed, vocab: [[seed * 7919 + i] * length for i in range(n)]  # noqa: E731
    r = ge.maxdecode(llm, res, 1_000, 64, prompts, 1, 100, _SP, {})
    assert r["batch"] == (13 if cached else 12)  # fewer extra tokens a request: one more fits
    assert r["full_steps"] >= 64 - 8 - 2  # the last few steps run under the profiler
    assert r["decode_tok_s"] > 0 and r["all_tokens"] is True
    assert ("t_prefill_all" in r) == cached
    # with the cache the timed pass recomputes one block each: 67 tokens, not 64 + 47 + 2
    assert r["generated"] == (64 + 1 + 2 if cached else 64 + 47 + 2)


def test_the_start_sampler_counts_inclusive_and_leaf_time():
    sys.path.insert(0, str(BENCH))
    try:
        from stack_sampler import StackSampler
    finally:
        sys.path.remove(str(BENCH))
    import time

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def outer() -> None:
        spin(0.4)
        time.sleep(0.4)

    with StackSampler(interval=0.01) as s:
        outer()
    inclusive = dict((name, t) for t, name in s.top(50))
    leaf = dict((name, t) for t, name in s.top(50, leaf=True))
    name = Path(__file__).name
    assert inclusive[f"{name}:outer"] == pytest.approx(0.8, abs=0.2)
    assert inclusive[f"{name}:spin"] == pytest.approx(0.4, abs=0.2)
    assert leaf[f"{name}:spin"] == pytest.approx(0.4, abs=0.2)
    assert leaf[f"{name}:outer"] == pytest.approx(0.4, abs=0.2)  # time.sleep is C: outer is the leaf


def test_cold_cases_get_compile_caches_of_their_own_and_start_ratios(ge, tmp_path, monkeypatch):
    """--caches cold: each case's process gets its own Triton, Inductor and vLLM cache folders (a
    case run second must not find the kernels the first compiled), the same ones for its second
    start; the summary holds cold and warm start ratios against FA3's."""
    a, b = ge.case_cache_env(tmp_path, "qwen-oscar-cache"), ge.case_cache_env(tmp_path, "qwen-bf16-fa3")
    assert set(a) == {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT"}
    assert len(set(a.values()) | set(b.values())) == 6
    assert a == ge.case_cache_env(tmp_path, "qwen-oscar-cache")
    seen = {}

    class Done:
        stdout, stderr, returncode = ge.RESULT + '{"start_s": 12.5}\n', "", 0

    def run(cmd, **kw):
        seen.update(kw)
        return Done()

    monkeypatch.setattr(ge.subprocess, "run", run)
    import io

    log = io.StringIO()
    r = ge._run_one({"name": "x", "work": []}, 10, log, a)
    assert r["start_s"] == 12.5 and seen["env"]["TRITON_CACHE_DIR"] == a["TRITON_CACHE_DIR"]
    assert seen["env"]["PATH"]  # the rest of the environment passes through
    ge._run_one({"name": "x", "work": []}, 10, log)
    assert seen["env"] is None and "===== x rc=0" in log.getvalue()
    res = {
        "qwen-bf16-fa3": {"start_s": 60.0, "start_warm_s": 40.0},
        "qwen-oscar-cache": {"start_s": 90.0, "start_warm_s": 50.0},
    }
    out = ge._compare(res)
    assert out["start_ratio[qwen-oscar-cache]"] == 1.5 and out["start_warm_ratio[qwen-oscar-cache]"] == 1.25


def test_shared_hits_times_the_hits_and_profiles_their_host_time(ge, monkeypatch):
    """The prefix-hit workload on a miniature engine: the prefix computed once, two timed batches of
    hits, one batch under the (stubbed) torch profiler and one under cProfile from ``add_request``
    on, so the host time a hit costs (request processing, hashing, scheduling) is in the profile."""

    def drain(eng, steps):  # noqa: ANN001, ANN202 - the torch profiler's stand-in runs the batch too
        n = 0
        while eng.has_unfinished_requests():
            eng.step()
            n += 1
        return {"steps": n}

    monkeypatch.setattr(ge, "_gpu_kernels", drain)
    llm = _LLM(budget=256, block=16)
    prompts = lambda n, length, seed, vocab: [[seed * 7919 + i] * length for i in range(n)]  # noqa: E731
    r = ge.shared_hits(llm, 1_000, 4, 8, prompts, 1, 100, _SP, {})
    hit = r["shared_1000x4"]
    assert hit["all_tokens"] is True and hit["ms_per_hit"] >= 0 and hit["run_tok_s"] > 0
    assert r["hits_profile_1000x4"]["steps"] >= 1
    prof = r["hits_pyprofile_1000x4"]
    assert prof["steps"] >= 1 and prof["ms_per_step_profiled"] > 0
    names = [row[0] for row in prof["top_cum_ms"]]
    assert any(n.endswith(":add_request") for n in names) and any(n.endswith(":step") for n in names)
    assert not llm.llm_engine.reqs  # every batch ran to completion
    assert "hits_pyprofile_1000x4" not in ge.shared_hits(
        llm, 1_000, 4, 8, prompts, 2, 100, _SP, {}, profile=False
    )
