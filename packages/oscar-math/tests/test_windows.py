"""The window rule (oscar_math.windows) against its definition, position by position."""

from __future__ import annotations

import pytest
import torch

from oscar_math import bf16_ring_start, int2_mask


@pytest.mark.parametrize("sink,recent", [(0, 0), (0, 3), (2, 0), (2, 3), (4, 1), (3, 7)])
def test_int2_mask_and_ring_start_follow_the_definition(sink, recent):
    n = 20
    q = torch.arange(n)
    mask = int2_mask(q, torch.arange(n), sink, recent)
    for t in range(n):
        for j in range(t + 1):
            assert bool(mask[t, j]) == (sink <= j <= t - recent), (t, j)
        bf16 = [j for j in range(t + 1) if not mask[t, j]]
        start = bf16_ring_start(t, sink, recent)
        # BF16 keys of query t: the sink, then one run [start, t] (empty when recent = 0)
        assert bf16 == list(range(min(sink, t + 1))) + list(range(start, t + 1)), (t, bf16)
        assert len(range(start, t + 1)) <= recent


def test_the_query_reads_its_own_key_in_bf16_unless_recent_is_zero():
    q = torch.tensor([10])
    assert not int2_mask(q, q, 0, 1)[0, 0] and int2_mask(q, q, 0, 0)[0, 0]
    assert bf16_ring_start(10, 0, 1) == 10 and bf16_ring_start(10, 0, 0) == 11
    assert bf16_ring_start(5, 8, 256) == 8  # inside the sink: the ring starts after it
