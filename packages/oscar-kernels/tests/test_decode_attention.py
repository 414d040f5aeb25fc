import pytest
import torch
from conftest import DEVICE, fill_cache, needs_triton

from oscar_kernels import CacheLayout, KernelUnavailableError, decode_attention, decode_attention_ref
from oscar_math import OscarError


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@needs_triton
@pytest.mark.parametrize(
    "d, h, g, page, group, granularity, splits",
    [
        (64, 2, 4, 16, None, "layer", 3),
        (64, 1, 1, 8, 32, "kv_head", 1),
        (128, 2, 8, 16, None, "kv_head", 2),
        (32, 3, 3, 4, 8, "layer", 5),
    ],
)
def test_decode_triton_matches_reference(d, h, g, page, group, granularity, splits):
    gen = torch.Generator().manual_seed(d * g)
    lo = CacheLayout(h, d, page_size=page, group_size=group, sink_tokens=5, recent_tokens=12)
    # empty, shorter than the sink, = sink + recent, one over, page boundaries, longer
    lens = [0, 3, 17, 18, 2 * page, 2 * page + 1, 83]
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, granularity, steps=2)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(lens), h * g, d, generator=gen).bfloat16().to(DEVICE)
    out = decode_attention(q, cache, params, bt, sl, ws, backend="triton", num_splits=splits, block_n=16)
    ref = decode_attention_ref(q, cache, params.expand(h, d, cache.device), bt, sl, ws)
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0  # empty sequence
    for b in range(1, len(lens)):
        assert rel(out[b], ref[b]) < 1e-2, (b, lens[b])


def test_decode_input_errors():
    gen = torch.Generator().manual_seed(0)
    lo = CacheLayout(2, 32, page_size=8, sink_tokens=2, recent_tokens=3)
    cache, params, bt, ws, _, _ = fill_cache(lo, [9], gen)
    sl = torch.tensor([9], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 4, 32, device=DEVICE)
    with pytest.raises(OscarError, match="heads of q"):
        decode_attention(q[:, :3], cache, params, bt, sl, ws)
    with pytest.raises(OscarError, match="dtype of seq_lens"):
        decode_attention(q, cache, params, bt, sl.float(), ws)
    with pytest.raises(OscarError, match="backend"):
        decode_attention(q, cache, params, bt, sl, ws, backend="cuda")


@pytest.mark.skipif(DEVICE.type == "cuda", reason="checks the CPU refusal of the Triton backend")
def test_triton_backend_refused_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    gen = torch.Generator().manual_seed(0)
    lo = CacheLayout(1, 16, page_size=4, sink_tokens=1, recent_tokens=1)
    cache, params, bt, ws, _, _ = fill_cache(lo, [5], gen)
    q = torch.randn(1, 1, 16)
    with pytest.raises(KernelUnavailableError, match="backend='torch'"):
        decode_attention(q, cache, params, bt, torch.tensor([5], dtype=torch.int32), ws, backend="triton")
