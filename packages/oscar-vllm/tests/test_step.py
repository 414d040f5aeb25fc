"""The backend's per-step logic without vLLM: window slots, metadata, and the GPU check script."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from oscar_math.errors import OscarError
from oscar_vllm.step import WindowSlots, build_step


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


def test_build_step_positions_and_decode_detection():
    qsl = torch.tensor([0, 1, 4, 5], dtype=torch.int32)  # decode, 3-token chunk, decode
    seq = torch.tensor([10, 7, 3], dtype=torch.int32)
    table = torch.tensor([[5, 6], [8, 0], [9, 0]], dtype=torch.int32)
    slot = torch.tensor([1, 2, 3, 4, 5, -1, -1])
    md = build_step(qsl, qsl, seq, seq, table, slot, 3, torch.tensor([2, 0, 1]), None)
    assert md.num_actual_tokens == 5 and md.max_query_len == 3 and not md.all_decode
    assert md.positions.tolist() == [9, 4, 5, 6, 2]
    assert md.seq_index.tolist() == [0, 1, 1, 1, 2]
    assert md.prefix_lens.tolist() == [9, 4, 2]
    assert md.slot_mapping.tolist() == [1, 2, 3, 4, 5]
    assert md.window_slots.tolist() == [2, 0, 1]
    md2 = build_step(qsl[:2], qsl[:2], seq[:1], seq[:1], table[:1], slot[:1], 1, torch.tensor([3]), None)
    assert md2.all_decode and md2.window_slots.tolist() == [3]
    with pytest.raises(OscarError, match="prefix-cache hit"):  # V1 path: continuing rows never seen
        build_step(qsl, qsl, seq, seq, table, slot, 3, None, WindowSlots(4))


def test_gpu_check_script_reduced_on_cpu(monkeypatch):
    """The script the coordinator runs on the H200, in its reduced form through the Triton interpreter."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (pip install 'oscar-kernels[triton]')")
    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("TRITON_INTERPRET must be set before Triton is imported")
    path = Path(__file__).parents[1] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("oscar_vllm_gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
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
