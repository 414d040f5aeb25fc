"""Position-aware key centering (emulation only): the RoPE is transformers', the pre-RoPE mean is
the mean of k_proj's output, and keys that are exactly RoPE_p(m) quantise without error."""

from __future__ import annotations

import pytest
import torch

from oscar_calib.calibrate import CalibrationConfig, calibrate
from oscar_calib.models import tiny_random_model
from oscar_calib.rope_mean import RopeMeanScheme, apply_rope, prerope_key_means, rope_inv_freq
from oscar_calib.schemes import SchemeContext, build_scheme
from oscar_calib.text import builtin_text, split_text, token_chunks

transformers_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


@pytest.fixture(scope="module")
def llama():
    return tiny_random_model("llama", num_hidden_layers=2)


def test_apply_rope_is_transformers_rope_and_inverts(llama):
    model, _ = llama
    torch.manual_seed(0)
    t, h, d = 37, 2, model.config.hidden_size // model.config.num_attention_heads
    x = torch.randn(t, h, d, dtype=torch.float64)
    pos = torch.arange(t)
    cos, sin = model.model.rotary_emb(x.float()[None], pos[None])  # [1, T, d]
    want, _ = transformers_llama.apply_rotary_pos_emb(
        x.float().transpose(0, 1)[None], x.float().transpose(0, 1)[None], cos, sin
    )
    got = apply_rope(x, pos, rope_inv_freq(model))
    torch.testing.assert_close(got.float(), want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(apply_rope(got, -pos, rope_inv_freq(model)), x, atol=1e-12, rtol=1e-12)


def test_prerope_mean_is_the_mean_of_k_proj(llama):
    model, tok = llama
    _, held = split_text(builtin_text())
    chunks = token_chunks(tok, held, 48, 96, 0)
    sink = 5
    hd = model.config.hidden_size // model.config.num_attention_heads
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):

        def hook(mod, inp, out, i=i):  # pre-RoPE keys: k_proj's output (llama has no k-norm)
            seen.setdefault(i, []).append(out[0, sink:].reshape(out.shape[1] - sink, -1, hd))

        hooks.append(layer.self_attn.k_proj.register_forward_hook(hook))
    try:
        means = prerope_key_means(model, chunks, sink=sink)
    finally:
        for hk in hooks:
            hk.remove()
    assert len(means) == 2
    for i, m in enumerate(means):
        want = torch.cat(seen[i]).double().mean(0).float()
        torch.testing.assert_close(m, want, atol=1e-5, rtol=1e-4)


def test_keys_equal_to_the_rotated_mean_quantise_exactly(llama):
    model, tok = llama
    rot = calibrate(
        model,
        tok,
        CalibrationConfig(tokens=256, seq_len=128, sink=8, recent=16, max_samples=128),
        progress=False,
    )
    base = build_scheme("oscar2", SchemeContext(rot.head_dim, 2, rot.num_kv_heads, rot))
    torch.manual_seed(1)
    m = [torch.randn(rot.num_kv_heads, rot.head_dim) * 3 for _ in range(2)]
    scheme = RopeMeanScheme(base, m, rope_inv_freq(model))
    keys = scheme.position_mean(1, 50, torch.device("cpu"))  # k_p = RoPE_p(m): constant before RoPE
    torch.testing.assert_close(scheme.fake_quantize_keys(1, keys), keys, atol=1e-5, rtol=0)
    # the static mean cannot follow the rotation: the served oscar2 keys carry an error
    assert (base.fake_quantize_keys(1, keys) - keys).abs().max() > 0.1
    # values and bits are oscar2's
    v = torch.randn(50, rot.num_kv_heads, rot.head_dim)
    assert torch.equal(scheme.fake_quantize_values(0, v), base.fake_quantize_values(0, v))
    assert scheme.bits_per_element(4096, rot.head_dim, 64, 256) == base.bits_per_element(
        4096, rot.head_dim, 64, 256
    )
