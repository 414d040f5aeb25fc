"""OscarCache: packed INT2 generation equals the simulated serving semantics."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from oscar_calib.cache import OscarCache, SchemeCache
from oscar_calib.needle import cache_kwarg
from oscar_calib.schemes import SchemeContext, build_scheme
from oscar_calib.simulate import Windows, simulate
from oscar_math.artifact import Rotations
from oscar_math.bits import bits_per_element
from oscar_math.rotation import hadamard_rotation

# The harness passes the cache under the name this transformers release takes (`cache` in
# 5.x): the deprecated `past_key_values` spelling would warn on every generate call.
pytestmark = pytest.mark.filterwarnings("error:.*past_key_values.*:FutureWarning")

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


ROPE_PAIRS = (0, 3, 5)


def fake_rotations(seed: int = 0, group_size: int = HEAD_DIM, rope: bool = False) -> Rotations:
    """A rotations artifact with per-KV-head random orthogonal rotations, key means and clips
    (``rope``: and a pre-RoPE key mean on :data:`ROPE_PAIRS`, format version 3)."""
    g = torch.Generator().manual_seed(seed)

    def rot():
        return torch.linalg.qr(torch.randn(KV_HEADS, HEAD_DIM, HEAD_DIM, generator=g, dtype=torch.float64))[
            0
        ].float()

    layers = []
    for _ in range(LAYERS):
        layers.append(
            {
                "k_rotation": rot(),
                "v_rotation": rot(),
                "k_mean": 0.1 * torch.randn(KV_HEADS, HEAD_DIM, generator=g),
                "k_clip": torch.tensor([0.9, 0.95]),
                "v_clip": torch.tensor([1.0, 0.85]),
                "k_eigenvalues": torch.ones(KV_HEADS, HEAD_DIM),
                "v_eigenvalues": torch.ones(KV_HEADS, HEAD_DIM),
            }
        )
        if rope:
            m = torch.zeros(KV_HEADS, HEAD_DIM)
            for i in ROPE_PAIRS:  # large against the keys: a wrong position shows
                m[:, i] = 2.0 * torch.randn(KV_HEADS, generator=g)
                m[:, i + HEAD_DIM // 2] = 2.0 * torch.randn(KV_HEADS, generator=g)
            layers[-1]["k_rope_mean"] = m
    extra = {}
    if rope:
        extra["rope_inv_freq"] = 10000.0 ** (-torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM)
    return Rotations(
        model="tiny-llama",
        num_layers=LAYERS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        group_size=group_size,
        sink_tokens=3,
        recent_tokens=5,
        granularity="kv_head",
        calibration={"source": "random"},
        **extra,
        **{name: [layer[name] for layer in layers] for name in layers[0]},
    )


def scheme(name: str = "oscar2", rope: bool = False, **kw):
    ctx = SchemeContext(HEAD_DIM, LAYERS, KV_HEADS, rotations=fake_rotations(rope=rope), **kw)
    return build_scheme(name, ctx)


def test_huge_windows_equal_plain_generation():
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(3))
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    cache = OscarCache(scheme(), LAYERS, Windows(sink=4, recent=1000))
    out = model.generate(ids, max_new_tokens=12, do_sample=False, **cache_kwarg(model, cache))
    assert torch.equal(out, ref)
    assert cache.layers[0].int2_keys is None and cache.get_seq_length() == 9 + 11


@pytest.mark.parametrize(
    "name,rope", [("oscar2", False), ("oscar2", True), ("hadamard2", False), ("int2", False)]
)
def test_generation_matches_simulated_decode(name, rope):
    model = tiny_llama(1)
    sch = scheme(name, rope=rope)
    win = Windows(sink=3, recent=5)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(4))  # prompt <= recent window
    cache = OscarCache(sch, LAYERS, win)
    gen = model.generate(
        ids,
        max_new_tokens=20,
        do_sample=False,
        **cache_kwarg(model, cache),
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert cache.layers[1].int2_keys.codes.shape[1] == 26 - 1 - 3 - 5  # tokens between the windows
    with torch.no_grad(), simulate(model, sch, win):
        sim = model(gen.sequences[:, :-1]).logits[0, 5:]
    got = torch.stack(gen.logits, 1)[0]
    torch.testing.assert_close(got, sim, atol=2e-4, rtol=1e-4)
    with torch.no_grad():  # and the quantisation did change something
        plain = model(gen.sequences[:, :-1]).logits[0, 5:]
    assert (plain - sim).abs().max() > 1e-3


@pytest.mark.parametrize("rope", [False, True])
def test_packed_cache_equals_fake_quant_cache_with_long_prompt(rope):
    model = tiny_llama(2)
    sch = scheme("oscar2", rope=rope)
    win = Windows(sink=2, recent=4)
    ids = torch.randint(0, 97, (1, 15), generator=torch.Generator().manual_seed(5))
    outs, caches = [], (OscarCache(sch, LAYERS, win), SchemeCache(sch, LAYERS, win), None)
    for cache in caches:  # None: plain generation, the unquantised reference
        g = model.generate(
            ids,
            max_new_tokens=8,
            do_sample=False,
            **cache_kwarg(model, cache),
            output_logits=True,
            return_dict_in_generate=True,
        )
        outs.append(torch.stack(g.logits, 1))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    # both caches were used (15 + 7 tokens seen) and quantisation changed the logits
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == 15 + 7
    assert (outs[0] - outs[2]).abs().max() > 1e-3


@pytest.mark.parametrize("group_size", [HEAD_DIM, 8])
def test_memory_matches_bits_per_element(group_size):
    sch = scheme("oscar2", group_size=group_size)
    win = Windows(sink=3, recent=7)
    cache = OscarCache(sch, LAYERS, win)
    g = torch.Generator().manual_seed(6)
    for chunk in (5, 1, 17, 1, 1):  # prefill then decode steps
        for i in range(LAYERS):
            k = torch.randn(1, KV_HEADS, chunk, HEAD_DIM, generator=g).to(torch.bfloat16)
            cache.update(k, torch.randn_like(k.float()).to(torch.bfloat16), i)
    n = 5 + 1 + 17 + 1 + 1
    expect = bits_per_element(n, HEAD_DIM, group_size=group_size, sink_tokens=3, recent_tokens=7)
    assert cache.bits_per_element() == pytest.approx(expect)
    assert cache.layers[0].int2_keys.codes.dtype == torch.uint8


def test_codec_roundtrip_matches_fake_quantize():
    sch = scheme("oscar2")
    x = torch.randn(11, KV_HEADS, HEAD_DIM)
    codec = sch.key_codec(1)
    torch.testing.assert_close(codec.decode(codec.encode(x), torch.float32), sch.fake_quantize_keys(1, x))
    _ = hadamard_rotation  # the baseline rotation is importable (used by hadamard2)


def test_rope_mean_changes_what_the_cache_serves():
    """Format version 3 is not a no-op: the same artifact without its pre-RoPE mean decodes
    other keys (the tests above would pass trivially if the mean were ignored)."""
    x = torch.randn(40, KV_HEADS, HEAD_DIM)
    with_mean, without = scheme("oscar2", rope=True), scheme("oscar2")
    assert with_mean.key_codec(1).rope_mean is not None and without.key_codec(1).rope_mean is None
    assert (with_mean.fake_quantize_keys(1, x) - without.fake_quantize_keys(1, x)).abs().max() > 1e-2
    # and a row's result depends on its position: position p+1 is not position p
    k = x[10:20]
    at = with_mean.fake_quantize_keys_at(1, k, torch.arange(10, 20))
    torch.testing.assert_close(at, with_mean.fake_quantize_keys(1, x)[10:20], rtol=0, atol=0)
    assert (at - with_mean.fake_quantize_keys_at(1, k, torch.arange(11, 21))).abs().max() > 1e-2
