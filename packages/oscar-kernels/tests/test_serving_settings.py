"""ServingSettings: one validated object for every engine's OSCAR options."""

from __future__ import annotations

import pytest

from oscar_kernels.serving.settings import ENV, KEYS, RadixCache, ServingSettings, WindowRecords
from oscar_math.errors import OscarError


def parse(section=None, env=None, **kw):  # noqa: ANN001, ANN003, ANN201
    return ServingSettings.parse(section, env or {}, "cfg", **kw)


def test_defaults_and_types():
    s = parse({"rotations": "r.st"})
    assert s == ServingSettings("r.st")
    assert s.radix_cache is RadixCache.EXACT and s.window_records is WindowRecords.AUTO
    assert s.split_extend is True and s.identity_restores is True and s.warmup is None
    assert s.dense_prefill is True and s.overlap_write is True and s.overlap_layers is True
    assert s.window_snapshots is None and s.step_log is None and s.exclude_layers == ()


def test_section_wins_over_environment_and_environment_fills_in():
    env = {ENV["rotations"]: "env.st", ENV["radix_cache"]: "INT2", ENV["split_extend"]: "0",
           ENV["warmup"]: "1", ENV["window_snapshots"]: "7", ENV["step_log"]: "/tmp/s.jsonl"}  # fmt: skip
    assert parse({"rotations": "r"}, {ENV["overlap_write"]: "0"}).overlap_write is False
    assert parse({"rotations": "r"}, {ENV["overlap_layers"]: "0"}).overlap_layers is False
    off = {ENV["overlap_layers"]: "0"}
    assert parse({"rotations": "r", "overlap_layers": True}, off).overlap_layers is True
    s = parse({}, env)
    assert (s.rotations, s.radix_cache, s.split_extend, s.warmup) == ("env.st", RadixCache.INT2, False, True)
    assert (s.window_snapshots, s.step_log) == (7, "/tmp/s.jsonl")
    s = parse({"rotations": "cfg.st", "radix_cache": "off", "split_extend": True, "warmup": False}, env)
    assert (s.rotations, s.radix_cache, s.split_extend, s.warmup) == ("cfg.st", RadixCache.OFF, True, False)
    assert ServingSettings.parse(None, {}, "cfg", require_rotations=False).rotations == ""


@pytest.mark.parametrize(
    ("section", "env", "match"),
    [
        ({}, {}, "needs a rotations artifact"),
        ({"rotations": "r", "radix": "exact"}, {}, r"unknown keys \['radix'\]"),
        ({"rotations": "r", "radix_cache": "sometimes"}, {}, r"cfg\['radix_cache'\].*off, exact, int2"),
        ({"rotations": "r"}, {ENV["radix_cache"]: "maybe"}, r"\$OSCAR_SGLANG_RADIX_CACHE"),
        ({"rotations": "r", "window_records": "always"}, {}, "window_records"),
        ({"rotations": "r"}, {ENV["warmup"]: "yes"}, r"\$OSCAR_VLLM_WARMUP: expected true/false"),
        ({"rotations": "r", "split_extend": 2}, {}, "split_extend"),
        ({"rotations": "r"}, {"OSCAR_DENSE_PREFILL": "yes"}, "OSCAR_DENSE_PREFILL"),
        ({"rotations": "r", "window_snapshots": 0}, {}, "window_snapshots.*>= 1"),
        ({"rotations": "r"}, {ENV["window_snapshots"]: "many"}, "OSCAR_SGLANG_WINDOW_SNAPSHOTS"),
        ({"rotations": "r", "exclude_layers": [1, True]}, {}, r"list of layer indices \(ints\)"),
        ({"rotations": "r", "exclude_layers": [3, 3]}, {}, r"lists layers \[3\] more than once"),
    ],
)
def test_bad_values_are_one_line_errors_naming_the_key(section, env, match):
    with pytest.raises(OscarError, match=match) as e:
        parse(section, env)
    assert "\n" not in str(e.value)


def test_every_key_is_parsed_and_every_variable_names_a_key():
    assert set(ENV) <= KEYS
    assert KEYS == {f.name for f in ServingSettings.__dataclass_fields__.values()}
    s = parse(
        {"rotations": "r", "exclude_layers": [5, 1], "window_records": "held", "identity_restores": False}
    )
    assert s.exclude_layers == (1, 5) and s.window_records is WindowRecords.HELD and not s.identity_restores
