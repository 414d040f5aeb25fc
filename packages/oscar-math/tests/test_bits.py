import pytest

from oscar_math import OscarError, bits_per_element, int2_bits_per_element, kivi_bits_per_element


def test_int2_bits_per_element_pinned():
    assert int2_bits_per_element(128) == 2.25
    assert int2_bits_per_element(64) == 2.5
    assert int2_bits_per_element(128, 32) == 3.0
    assert int2_bits_per_element(128, scale_bits=32, zero_bits=32) == 2.5  # fp32 metadata


def test_bits_per_element_pinned_values():
    # 320 BF16 tokens + 1728 INT2 tokens at 2.25 bits
    assert bits_per_element(2048, 128) == pytest.approx(9008 / 2048, abs=0)
    assert bits_per_element(2048, 128) == 4.3984375
    assert bits_per_element(2048, 64) == (320 * 16 + 1728 * 2.5) / 2048
    assert bits_per_element(131072, 128) == pytest.approx((320 * 16 + 130752 * 2.25) / 131072)
    assert round(bits_per_element(131072, 128), 4) == 2.2836  # the figure quoted in docs
    # without windows it is exactly the row cost
    assert bits_per_element(1000, 128, sink_tokens=0, recent_tokens=0) == 2.25


def test_short_sequences_are_all_bf16():
    assert bits_per_element(1, 128) == 16.0
    assert bits_per_element(320, 128) == 16.0
    assert bits_per_element(321, 128) == (320 * 16 + 2.25) / 321


def test_bits_decrease_towards_row_cost():
    vals = [bits_per_element(n, 128) for n in (512, 2048, 8192, 100_000)]
    assert all(a > b for a, b in zip(vals[:-1], vals[1:], strict=True))
    assert 2.25 < vals[-1] < 2.31


def test_kivi_bits_pinned():
    # keys: 1728 tokens -> 54 blocks of 32; values per token like OSCAR
    k = 320 * 16 + 1728 * 2 + 54 * 32
    v = 320 * 16 + 1728 * 2.25
    assert kivi_bits_per_element(2048, 128) == (k + v) / (2 * 2048)
    # partial final block pays a full metadata set: 1729 tokens -> 55 blocks
    k2 = 320 * 16 + 1729 * 2 + 55 * 32
    v2 = 320 * 16 + 1729 * 2.25
    assert kivi_bits_per_element(2049, 128) == (k2 + v2) / (2 * 2049)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"seq_len": 0, "head_dim": 128}, "seq_len"),
        ({"seq_len": 10, "head_dim": 128, "group_size": 48}, "group_size"),
        ({"seq_len": 10, "head_dim": 128, "sink_tokens": -1}, "sink_tokens"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(OscarError, match=name):
        bits_per_element(**kwargs)


def test_int2_copy_of_windows_is_the_serving_cache():
    # every token INT2 plus full BF16 window rows per sequence (oscar-kernels' paged cache)
    assert bits_per_element(2048, 128, int2_copy_of_windows=True) == 2.25 + 320 * 16 / 2048 == 4.75
    assert bits_per_element(2048, 64, int2_copy_of_windows=True) == 5.0  # SmolLM2 at 2k: vs 4.609
    assert bits_per_element(2048, 64) == 4.609375
    assert bits_per_element(10, 128, int2_copy_of_windows=True) == 2.25 + 320 * 16 / 10  # rows allocated
    assert bits_per_element(1000, 128, sink_tokens=0, recent_tokens=0, int2_copy_of_windows=True) == 2.25
