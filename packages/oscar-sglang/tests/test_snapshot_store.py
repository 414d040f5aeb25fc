"""The engine-independent bookkeeping of exact radix hits (no SGLang needed)."""

from __future__ import annotations

from array import array

from oscar_sglang.core import SnapshotStore, prefix_digests


def test_prefix_digests_identify_content_and_namespace():
    a = prefix_digests([1, 2, 3, 4, 5, 6, 7, 8, 9], None, None, 4, 9)
    assert len(a) == 2  # prefixes of 4 and 8 tokens (page-aligned, <= 9)
    assert prefix_digests(array("q", [1, 2, 3, 4, 5, 6, 7, 8]), None, None, 8, 8) == [a[1]]  # streaming
    b = prefix_digests([1, 2, 3, 4, 5, 6, 7, 0], None, None, 4, 8)
    assert b[0] == a[0] and b[1] != a[1]  # same first page, different second
    assert prefix_digests([1, 2, 3, 4], "lora-a", None, 4, 4) != a[:1]  # SGLang's extra_key namespace
    assert prefix_digests([1, 2, 3, 4], None, "salt", 4, 4) != a[:1]


def test_capture_publish_lookup_and_lru():
    gens = [0] * 4
    s = SnapshotStore(base=4, count=3)
    b1 = s.capture(1, 0, 8, gens, set())
    assert b1 in (4, 5, 6) and s.lookup(b"x") is None
    assert not s.publish(1, 0, 12, b"x")  # no candidate at that length
    assert not s.publish(1, 1, 8, b"x")  # another request in the slot
    assert s.publish(1, 0, 8, b"x") and s.lookup(b"x") == (b1, 8)
    b2 = s.capture(2, 0, 4, gens, set())
    assert s.publish(2, 0, 4, b"y")
    b3 = s.capture(3, 0, 4, gens, set())
    assert len({b1, b2, b3}) == 3
    s.lookup(b"x")  # x is now more recently used than y
    b4 = s.capture(3, 0, 8, gens, set())  # store full: the least recently used published (y) goes
    assert b4 == b2 and s.lookup(b"y") is None and s.lookup(b"x") == (b1, 8)
    assert s.capture(3, 0, 12, gens, {b1, b3, b4}) is None  # everything busy: no snapshot, no harm


def test_candidates_of_a_finished_request_are_recycled_first():
    gens = [0, 0, 0]
    s = SnapshotStore(base=3, count=2)
    s.capture(1, 0, 4, gens, set())
    assert s.publish(1, 0, 4, b"p")
    stale = s.capture(2, 0, 8, gens, set())  # slot 2's request leaves before publishing
    gens[2] = 1
    b = s.capture(1, 0, 8, gens, set())
    assert b == stale and s.lookup(b"p") is not None  # the stale candidate went, not the published one


def test_at_most_keep_per_slot_candidates():
    gens = [0, 0]
    s = SnapshotStore(base=2, count=4, keep_per_slot=2)
    c = [s.capture(1, 0, k, gens, set()) for k in (4, 8, 12)]
    assert len(s.slot_cands[1]) == 2 and s.slot_cands[1] == c[1:]
    assert not s.publish(1, 0, 4, b"a") and s.publish(1, 0, 8, b"b")
