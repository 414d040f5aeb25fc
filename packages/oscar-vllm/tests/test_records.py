"""Transient window records: vLLM's scheduler-side manager (records.py) and the worker's record
stamps (step.RecordStamps). The manager runs on vLLM's own BlockPool, no engine."""

from __future__ import annotations

import pytest

from oscar_kernels.serving import RecordStamps
from oscar_math.errors import OscarError

WB, IB, SINK, RECENT = 16, 128, 64, 256
PARTS = -(-(RECENT - 1) // WB)  # 16 window blocks always before a position: the sink in 16 parts


# ---- the manager (vLLM's scheduler side) ----------------------------------------------------


@pytest.fixture
def manager():
    pytest.importorskip("vllm", reason="vLLM is not installed (run the nox session 'vllm')")
    import torch
    from vllm.v1.core.block_pool import BlockPool

    from oscar_vllm.records import OscarWindowManager, OscarWindowSpec

    spec = OscarWindowSpec(
        block_size=WB, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=RECENT,
        state_content_bytes=40 * IB // WB,
    )  # fmt: skip
    pool = BlockPool(200, True, WB)
    return OscarWindowManager(
        spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0, scheduler_block_size=IB
    )


def _step(m, req: str, processed: int, new: int) -> None:
    """What vLLM's allocate_slots does for one chunk: free on the processed-token basis, allocate."""
    m.remove_skipped_blocks(req, processed)
    m.allocate_new_blocks(req, processed + new, processed + new)


def test_records_are_freed_once_written_and_the_open_block_is_held(manager):
    m, pool = manager, manager.block_pool
    free0 = pool.get_num_free_blocks()
    n = 0
    for chunk in (64, 64, 37, 1, 1, 1, 26, 1):  # prefill chunks, then decodes across a block end
        _step(m, "a", n, chunk)
        blocks = m.req_to_blocks["a"]
        # every block holding a position >= n (written this step or later) is held ...
        assert all(not b.is_null and b.ref_cnt == 1 for b in blocks[n // WB :])
        # ... and every block whose positions were all written before this step is freed
        assert all(b.is_null for b in blocks[: n // WB])
        held = len(blocks) - n // WB
        assert held <= -(-(n % WB + chunk) // WB)  # the open block plus this chunk's blocks
        n += chunk
    m.remove_skipped_blocks("a", n)  # after the last step: only the open block
    assert free0 - pool.get_num_free_blocks() == (1 if n % WB else 0)
    m.free("a")
    assert pool.get_num_free_blocks() == free0


def test_the_spec_counts_one_open_block_per_request_and_admits_the_in_flight_chunk(manager):
    spec = manager.kv_cache_spec
    assert spec.max_memory_usage_bytes(None) == spec.page_size_bytes
    # a 64-token chunk may start inside an open block: 4 blocks + 1
    assert spec.max_admission_blocks_per_request(max_in_flight_tokens=64, max_model_len=2048) == 5
    assert spec.max_admission_blocks_per_request(max_in_flight_tokens=4096, max_model_len=2048) == 129


def test_a_pool_that_cannot_admit_one_request_is_refused_at_start_up(manager):
    """One request of max_model_len needs its INT2 blocks plus the window records of an in-flight
    chunk; a smaller pool is one clear error (it passed vLLM's own check and then the scheduler
    waited forever: 20 blocks against 25 on the CPU build, 2026-12-03)."""
    from types import SimpleNamespace

    from oscar_vllm.records import check_admission

    int2 = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=IB))
    win = SimpleNamespace(kv_cache_spec=manager.kv_cache_spec)
    cfg = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=1024),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=256),
    )
    need = 1024 // IB + (256 // WB + 1)  # 8 INT2 blocks + 17 window blocks
    check_admission(cfg, SimpleNamespace(num_blocks=need, kv_cache_groups=[int2, win]))
    with pytest.raises(
        OscarError, match=rf"has {need - 1} blocks, but one request of max_model_len 1024 needs {need}"
    ):
        check_admission(cfg, SimpleNamespace(num_blocks=need - 1, kv_cache_groups=[int2, win]))
    check_admission(cfg, None)  # another vLLM's return value: nothing to check
    # the chunk named is the one a request can have: at most max_model_len tokens (the H200's
    # default of 32,768 batched tokens against max_model_len 4096 was printed as a 32768-token chunk)
    cfg.scheduler_config.max_num_batched_tokens = 8192
    need = 1024 // IB + (1024 // WB + 1)
    with pytest.raises(
        OscarError, match=rf"needs {need} \(its pages and the window records of a 1024-token chunk\)"
    ):
        check_admission(cfg, SimpleNamespace(num_blocks=need - 1, kv_cache_groups=[int2, win]))


def test_registration_keeps_vllms_own_specs_and_selects_the_manager():
    pytest.importorskip("vllm", reason="vLLM is not installed (run the nox session 'vllm')")
    import torch
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from oscar_vllm import records

    records.register()
    records.register()  # idempotent
    kw = {"block_size": 16, "num_kv_heads": 1, "head_size": 64, "dtype": torch.bfloat16}
    full = FullAttentionSpec(**kw)
    ours = records.OscarWindowSpec(sliding_window=8, **kw)
    assert KVCacheSpecRegistry.get_manager_class(full) is FullAttentionManager
    swa = SlidingWindowSpec(sliding_window=8, **kw)
    assert KVCacheSpecRegistry.get_manager_class(swa) is SlidingWindowManager
    assert KVCacheSpecRegistry.get_manager_class(ours) is records.OscarWindowManager
    assert KVCacheSpecRegistry.get_uniform_type_base_spec(ours) is SlidingWindowSpec


# ---- the worker's record stamps ---------------------------------------------------------------


def _tables(first_int2: int, first_window: int, n: int) -> tuple[list[int], list[int]]:
    """One request's INT2 and window block ids for ``n`` tokens (consecutive ids from the firsts)."""
    return (
        [first_int2 + i for i in range(-(-n // IB))],
        [first_window + j for j in range(-(-n // WB))],
    )


def _stamps() -> RecordStamps:
    s = RecordStamps()
    s.configure(WB, IB, SINK, RECENT, PARTS)
    return s


def _write(s: RecordStamps, step: int, it: list[int], wt: list[int], p: int, n: int, restore=()) -> None:
    """One step as the backend runs it: only the table entries ``columns`` names are gathered
    (``gather_columns``) from zero-padded tables, as from vLLM's ``[B, max_blocks]`` tensors."""
    import torch

    from oscar_kernels.serving import gather_columns

    width = 4 + max(len(it), len(wt))
    int2 = torch.zeros(1, width, dtype=torch.int32)
    int2[0, : len(it)] = torch.tensor(it)
    win = torch.zeros(1, 1, width, dtype=torch.int32)
    win[0, 0, : len(wt)] = torch.tensor(wt)
    int2_cols, win_cols = s.columns([p], [n], list(restore))
    s.step(step, gather_columns(int2, int2_cols)[0], gather_columns(win, win_cols), [p], [n], list(restore))


def test_stamps_accept_intact_records_and_refuse_reused_ones():
    s = _stamps()
    it, wt = _tables(1000, 2000, 896)
    step = 0
    for p in range(0, 896, 64):  # a request writes 896 tokens in 64-token chunks
        step += 1
        _write(s, step, it, wt, p, p + 64)
    # a hit of 768 reads its records: window blocks 32..47 (ring 513..767, sink parts)
    assert list(s.needed(768)) == list(range(32, 48))
    assert list(s.needed(128)) == list(range(0, 8))
    step += 1
    _write(s, step, it, wt, 768, 769, restore=[0])  # intact: accepted
    # a record block reused as an INT2 page of another request
    step += 1
    _write(s, step, [wt[40]], [3000, 3001, 3002, 3003], 0, 64)
    with pytest.raises(OscarError, match="freed and reused"):
        step += 1
        _write(s, step, it, wt, 768, 769, restore=[0])


def test_stamps_refuse_records_overwritten_by_another_prefix():
    s = _stamps()
    it, wt = _tables(1000, 2000, 512)
    for k, p in enumerate(range(0, 512, 64)):
        _write(s, k + 1, it, wt, p, p + 64)
    # the record block of positions 496..511 is reused for another request's positions 0..15
    _write(s, 100, [5000], [wt[31]], 0, 16)
    with pytest.raises(OscarError):
        _write(s, 101, it, wt, 512, 513, restore=[0])
    # an INT2 block freed and reused by another prefix: records stamped with it are stale
    s2 = _stamps()
    for k, p in enumerate(range(0, 512, 64)):
        _write(s2, k + 1, it, wt, p, p + 64)
    other_i, other_w = [it[0], 7777], [9000 + j for j in range(9)]
    _write(s2, 50, other_i, other_w, 0, 128)  # another request writes into INT2 block it[0]
    with pytest.raises(OscarError):
        _write(s2, 51, it, wt, 128, 129, restore=[0])
    # the same call for its own records passes
    _write(s2, 52, other_i, other_w, 128, 129, restore=[0])


def test_stamps_run_once_per_step():
    s = _stamps()
    it, wt = _tables(1000, 2000, 300)
    _write(s, 1, it, wt, 0, 64)
    n = s.checked
    _write(s, 2, it, wt, 64, 65, restore=[0])
    once = s.checked - n
    assert once > 0
    _write(s, 2, it, wt, 64, 65, restore=[0])  # the other layers of the same step: no work
    assert s.checked - n == once
