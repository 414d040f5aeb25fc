import pytest
import torch

from oscar_kernels import CacheLayout, allocate_cache, bits_per_element, layout_bytes_per_token
from oscar_math import OscarError


def test_bits_per_element_is_2_25_at_d128_group_d():
    lo = CacheLayout(num_kv_heads=8, head_dim=128)
    assert bits_per_element(lo) == pytest.approx(2.25)
    # K+V, 8 heads, 32 code bytes + 4 metadata bytes each
    assert layout_bytes_per_token(lo) == 2 * 8 * 36


def test_windows_are_counted():
    lo = CacheLayout(num_kv_heads=8, head_dim=128, sink_tokens=64, recent_tokens=256)
    for n in (1000, 8192, 131072):
        assert bits_per_element(lo, n) == pytest.approx(2.25 + 16 * 320 / n)
    assert bits_per_element(CacheLayout(4, 128, group_size=32)) == pytest.approx(3.0)
    assert bits_per_element(CacheLayout(4, 64)) == pytest.approx(2.5)


def test_allocate_shapes_and_validate():
    lo = CacheLayout(3, 64, page_size=16, group_size=32, sink_tokens=5, recent_tokens=7)
    c = allocate_cache(lo, num_pages=11, max_seqs=2)
    assert c.k_codes.shape == (11, 3, 16, 16) and c.k_codes.dtype == torch.uint8
    assert c.v_scale.shape == (11, 3, 16, 2) and c.v_scale.dtype == torch.bfloat16
    assert c.k_sink.shape == (2, 3, 5, 64) and c.v_recent.shape == (2, 3, 7, 64)
    c.validate()
    c.k_zero = c.k_zero[:, :, :, :1]
    with pytest.raises(OscarError, match="shape of k_zero"):
        c.validate()


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(num_kv_heads=0, head_dim=64), "num_kv_heads"),
        (dict(num_kv_heads=2, head_dim=72), "head_dim"),
        (dict(num_kv_heads=2, head_dim=64, group_size=24), "group_size"),
        (dict(num_kv_heads=2, head_dim=64, recent_tokens=-1), "recent_tokens"),
    ],
)
def test_invalid_layout(kw, name):
    with pytest.raises(OscarError, match=f"Invalid {name}"):
        CacheLayout(**kw)


def test_cache_from_page_buffer_views_one_engine_allocation():
    from oscar_kernels import cache_from_page_buffer, page_bytes

    lo = CacheLayout(3, 64, page_size=4, group_size=32)
    assert page_bytes(lo) == 2 * 3 * 4 * 16 + 4 * 3 * 4 * 2 * 2
    buf = torch.zeros(5, page_bytes(lo) + 6, dtype=torch.uint8)[:, 2 : 2 + page_bytes(lo)]  # padded rows
    c = cache_from_page_buffer(lo, buf, max_seqs=2)
    c.v_zero[3, 1, 2, 1] = 1.5
    c.k_codes[4, 2, 3, 15] = 7
    assert buf[4].tolist().count(7) == 1 and c.k_codes.data_ptr() == buf.data_ptr()
    assert (
        float(c.v_zero[3, 1, 2, 1]) == 1.5
        and c.v_zero.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    )
    with pytest.raises(OscarError, match="shape of page_buffer"):
        cache_from_page_buffer(lo, buf[:, 1:], max_seqs=2)


@pytest.mark.parametrize(
    "h, d, page, group, sink, recent",
    [(8, 128, 64, None, 64, 256), (3, 64, 16, 32, 5, 7), (2, 32, 4, 8, 0, 0)],
)
def test_bits_per_element_is_oscar_math_and_what_is_allocated(h, d, page, group, sink, recent):
    """One definition (oscar_math.bits_per_element with the INT2 copy of the windows), and it
    counts exactly the bytes allocate_cache holds for one sequence filling every page."""
    from oscar_kernels import page_bytes
    from oscar_math import bits_per_element as math_bits

    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=sink, recent_tokens=recent)
    pages = 5
    n = pages * page
    cache = allocate_cache(lo, num_pages=pages, max_seqs=1)
    stored = sum(getattr(cache, f).nbytes for f in vars(cache) if f != "layout")
    assert bits_per_element(lo, n) == stored * 8 / (2 * h * d * n)
    assert bits_per_element(lo, n) == math_bits(
        n, d, group_size=group, sink_tokens=sink, recent_tokens=recent, int2_copy_of_windows=True
    )
    assert layout_bytes_per_token(lo) == page_bytes(lo) / page
    assert layout_bytes_per_token(lo, n) * n == pytest.approx(stored, rel=1e-12)


def test_tensor_fields_are_every_tensor_attribute():
    import dataclasses

    from oscar_kernels import PagedKVCache

    declared = tuple(f.name for f in dataclasses.fields(PagedKVCache) if f.name != "layout")
    assert PagedKVCache.TENSOR_FIELDS == declared
