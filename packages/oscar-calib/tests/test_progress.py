"""Time-left bookkeeping of the evaluation's progress lines."""

from __future__ import annotations

import pytest

from oscar_calib.progress import Step, StepClock, format_seconds
from oscar_math import OscarError


def _plan():
    # two sequences at 1000 tokens (reference, one scheme, metrics), then one at 2000
    seq = [Step("forward", "ref", 1000), Step("forward", "int2", 1000), Step("metrics", 2, 1000)]
    return [*seq, *seq, Step("forward", "ref", 2000), Step("passkey", "int2", 500, like="forward")]


def test_unknown_until_every_kind_has_a_rate():
    clock = StepClock(_plan())
    assert clock.left() is None and "not known" in clock.status()
    clock.finish(2.0)  # ref: forward rate 2 ms/token; no metrics step finished yet
    assert clock.left() is None
    assert clock.expected(Step("forward", "int2", 1000)) == pytest.approx(2.0)  # kind mean, not "ref"'s own


def test_estimates_use_the_last_time_of_the_same_step_then_the_kind_rate_scaled_by_size():
    clock = StepClock(_plan())
    for seconds in (2.0, 6.0, 1.0):  # first sequence: ref, int2, metrics
        clock.finish(seconds)
    # second sequence repeats the first exactly; then ref at 2000 tokens: forward rate
    # (2/1000 + 6/1000) / 2 = 4 ms/token -> 8 s; passkey (like forward) 500 tokens -> 2 s
    assert clock.left() == pytest.approx(2.0 + 6.0 + 1.0 + 8.0 + 2.0)
    clock.finish(3.0)  # ref of the second sequence was slower: the last time counts
    assert clock.expected(Step("forward", "ref", 1000)) == 3.0
    assert clock.left() == pytest.approx(6.0 + 1.0 + (2 + 6 + 3) / 3 * 2.0 + (2 + 6 + 3) / 3 * 0.5)
    assert clock.status().startswith("step 4/8, ~")


def test_passkey_rate_replaces_the_stand_in_once_measured():
    clock = StepClock([Step("forward", "a", 100), Step("passkey", "x", 100, like="forward")] * 2)
    clock.finish(1.0)
    assert clock.left() == pytest.approx(3.0)  # both passkey steps at forward's rate
    assert clock.expected(Step("passkey", "x", 100)) is None  # no stand-in named: unknown
    clock.finish(5.0)
    assert clock.expected(Step("passkey", "y", 100, like="forward")) == 5.0  # its own kind now


def test_all_done_and_overrun():
    clock = StepClock([Step("forward", "a")])
    clock.finish(1.5)
    assert clock.left() == 0 and clock.status() == "step 1/1, ~0 s left"
    with pytest.raises(OscarError, match="finished steps"):
        clock.finish(1.0)


def test_format_seconds():
    assert format_seconds(41.6) == "42 s"
    assert format_seconds(185) == "3 min 05 s"
    assert format_seconds(3725) == "1 h 02 min"
    assert format_seconds(-3) == "0 s"
