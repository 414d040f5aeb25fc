"""attention_override: the transformers attention-function hook OSCAR uses everywhere."""

from __future__ import annotations

import pytest
import torch

from oscar_calib.attention import attention_modules, attention_override, sdpa_attention
from oscar_calib.models import tiny_random_model

FAMILIES = ["llama", "qwen3", "mistral", "qwen2"]


def _ids(length: int, batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", FAMILIES)
def test_pass_through_matches_model_sdpa(family):
    model, _ = tiny_random_model(family)
    ids = _ids(37)
    with torch.no_grad():
        expected = model(ids).logits
        calls = []

        def passthrough(ctx, q, k, v, mask, scaling, **kw):
            calls.append((ctx.layer_idx, tuple(q.shape), tuple(k.shape)))
            return sdpa_attention(q, k, v, mask, scaling)

        with attention_override(model, passthrough):
            got = model(ids).logits
        after = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, expected), "the original implementation was not restored"
    cfg = model.config
    # query [B, H_q, T, d] and key [B, H_kv, S, d] (not repeated), once per layer
    assert calls == [
        (i, (2, cfg.num_attention_heads, 37, cfg.head_dim), (2, cfg.num_key_value_heads, 37, cfg.head_dim))
        for i in range(cfg.num_hidden_layers)
    ]
    assert model.config._attn_implementation == "sdpa"


def test_override_changes_output_and_sees_qk_norm():
    model, _ = tiny_random_model("qwen3")
    attn = attention_modules(model)[0]
    with torch.no_grad():
        # RMSNorm makes each head row RMS 1 times its weight, and RoPE preserves norms:
        # constant norm weights make the captured q/k rows have exactly that RMS.
        attn.q_norm.weight.fill_(2.5)
        attn.k_norm.weight.fill_(0.5)
    ids = _ids(19, batch=1)
    seen = {}

    def record(ctx, q, k, v, mask, scaling, **kw):
        seen[ctx.layer_idx] = (q.clone(), k.clone())
        return sdpa_attention(q, k, v, mask, scaling) * 0.5

    with torch.no_grad():
        base = model(ids).logits
        with attention_override(model, record):
            changed = model(ids).logits
    assert not torch.allclose(base, changed)
    q, k = seen[0]
    assert q.shape == (1, 4, 19, 128) and k.shape == (1, 2, 19, 128)
    q_rms, k_rms = q.pow(2).mean(-1).sqrt(), k.pow(2).mean(-1).sqrt()
    torch.testing.assert_close(q_rms, torch.full_like(q_rms, 2.5), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(k_rms, torch.full_like(k_rms, 0.5), rtol=1e-3, atol=1e-3)


def test_restores_on_error_and_nesting():
    model, _ = tiny_random_model("llama")
    ids = _ids(9, batch=1)

    def boom(ctx, q, k, v, mask, scaling, **kw):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        with attention_override(model, boom):
            model(ids)
    assert model.config._attn_implementation == "sdpa"

    order = []

    def outer(ctx, q, k, v, mask, scaling, **kw):
        order.append("outer")
        return sdpa_attention(q, k, v, mask, scaling)

    def inner(ctx, q, k, v, mask, scaling, **kw):
        order.append("inner")
        return sdpa_attention(q, k, v, mask, scaling)

    with torch.no_grad(), attention_override(model, outer):
        with attention_override(model, inner):
            model(ids)
        model(ids)
    layers = model.config.num_hidden_layers
    assert order == ["inner"] * layers + ["outer"] * layers
    assert model.config._attn_implementation == "sdpa"


def test_generate_with_cache_matches():
    model, _ = tiny_random_model("llama")
    ids = _ids(11, batch=1)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False)
        with attention_override(model, lambda ctx, q, k, v, m, s, **kw: sdpa_attention(q, k, v, m, s)):
            got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("q_len,kv_len", [(1, 13), (5, 13), (13, 13)])
def test_sdpa_attention_gqa_reference(q_len, kv_len):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, q_len, 24, generator=g)
    k = torch.randn(2, 3, kv_len, 24, generator=g)
    v = torch.randn(2, 3, kv_len, 24, generator=g)
    out = sdpa_attention(q, k, v, None, 0.3)
    assert out.shape == (2, q_len, 6, 24)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    logits = (q @ kk.transpose(-1, -2)) * 0.3
    pos = torch.arange(q_len)[:, None] + kv_len - q_len
    logits = logits.masked_fill(pos < torch.arange(kv_len)[None, :], float("-inf"))
    ref = (logits.softmax(-1) @ vv).transpose(1, 2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # an explicit boolean mask and the equivalent additive mask agree
    bool_mask = torch.rand(2, 1, q_len, kv_len, generator=g) > 0.3
    bool_mask[..., 0] = True
    additive = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, float("-inf"))
    torch.testing.assert_close(
        sdpa_attention(q, k, v, bool_mask, 0.3), sdpa_attention(q, k, v, additive, 0.3)
    )
