"""Cross-package contract: one artifact, three consumers, one answer.

A rotations artifact written and re-loaded through ``oscar_math`` drives (a) the
evaluation harness's ``oscar2`` scheme in ``oscar_calib`` (fake quantisation in the
original basis) and (b) the paged cache of ``oscar_kernels`` (write + decode in the
rotated basis). Both must give the attention output that a float64 computation from
the INT2 contract alone gives.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from oscar_math import fake_quantize_int2
from oscar_math.artifact import Rotations, load_rotations, save_rotations
from oscar_math.eigen import eigenbasis
from oscar_math.plugins import available_schemes
from oscar_math.rotation import compose_rotation

H_Q, H_KV, D, LAYERS = 4, 2, 64, 2
SINK, RECENT = 8, 16


#: RoPE inverse frequencies of the version-3 case (float32, as the artifact stores them)
INV_FREQ = (10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)).float()
#: frequency pairs carrying its pre-RoPE key mean (high, mid and low frequency)
ROPE_PAIRS = (1, 9, 20, 27)


def _random_rotations(
    tmp_path, group_size: int, granularity: str, feedback: bool = False, rope: bool = False
) -> Rotations:
    g = torch.Generator().manual_seed(3)
    G = H_KV if granularity == "kv_head" else 1
    layers = []
    for _ in range(LAYERS):
        rot = {}
        for kind in ("k", "v"):
            a = torch.randn(G, D, D, generator=g, dtype=torch.float64)
            lam, u = eigenbasis(a @ a.transpose(-1, -2))
            rot[f"{kind}_rotation"] = compose_rotation(u, group_size).float()
            rot[f"{kind}_eigenvalues"] = lam.float()
        rot["k_clip"] = torch.tensor([0.8, 0.95])[:G]
        rot["v_clip"] = torch.tensor([0.9, 1.0])[:G]
        rot["k_mean"] = torch.randn(G, D, generator=g)
        if feedback:  # error-feedback codes (format version 2) from random anisotropic metrics
            from oscar_math.feedback import feedback_matrix

            for kind in ("k", "v"):
                a = torch.randn(G, D, D, generator=g, dtype=torch.float64) * torch.logspace(0, -2, D)
                rot[f"{kind}_feedback"] = feedback_matrix(a @ a.transpose(-1, -2))
        if rope:  # pre-RoPE key mean on a few pairs (format version 3)
            m = torch.zeros(G, D)
            for i in ROPE_PAIRS:
                m[:, i], m[:, i + D // 2] = 3 * torch.randn(G, generator=g), 3 * torch.randn(G, generator=g)
            rot["k_rope_mean"] = m
        layers.append(rot)
    rotations = Rotations(
        model="contract-test",
        num_layers=LAYERS,
        num_kv_heads=H_KV,
        head_dim=D,
        group_size=group_size,
        sink_tokens=SINK,
        recent_tokens=RECENT,
        granularity=granularity,
        calibration={"source": "random"},
        rope_inv_freq=INV_FREQ if rope else None,
        **{name: [layer[name] for layer in layers] for name in layers[0]},
    )
    path = tmp_path / "rot.safetensors"
    save_rotations(path, rotations)
    return load_rotations(path, num_layers=LAYERS, num_kv_heads=H_KV, head_dim=D)


def _rope_of_mean(m, positions):
    """``RoPE_p(m)`` written out (rotate-half pairs ``i``, ``i + d/2``): ``[d]`` → ``[T, d]`` float64."""
    ang = positions.double()[:, None] * INV_FREQ.double()[None, :]  # [T, d/2]
    a, b = m[: D // 2].double(), m[D // 2 :].double()
    return torch.cat((a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()), dim=-1)


def _contract_fake_quant(x, rot, mean, clip, group_size, feedback=None, rope_mean=None, positions=None):
    """[T, H, d] → [T, H, d] float64 straight from the documented contract (rows at ``positions``)."""
    from oscar_math.feedback import fake_quantize_int2_feedback

    out = torch.empty_like(x, dtype=torch.float64)
    H = x.shape[1]
    rot, clip = rot.expand(H, -1, -1), clip.expand(H)
    mean = mean.expand(H, -1) if mean is not None else None
    fb = feedback.expand(H, -1, -1) if feedback is not None else None
    for h in range(H):
        centre = mean[h].double() if mean is not None else torch.zeros(x.shape[-1], dtype=torch.float64)
        if rope_mean is not None:  # format version 3: the INT2 row of position p is centred by RoPE_p(m) too
            centre = centre + _rope_of_mean(rope_mean.expand(H, -1)[h], positions)
        xr = (x[:, h].double() - centre) @ rot[h].double()
        if fb is None:
            xq = fake_quantize_int2(xr.float(), group_size, float(clip[h])).double()
        else:
            xq = fake_quantize_int2_feedback(xr.float(), group_size, fb[h], float(clip[h])).double()
        out[:, h] = xq @ rot[h].double().T + centre
    return out


def _attend(q, k, v):
    """One query per head over all keys, GQA; q [H_q, d], k/v [T, H_kv, d] → [H_q, d] float64."""
    g = H_Q // H_KV
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    logits = torch.einsum("hd,thd->ht", q.double(), kk) / math.sqrt(D)
    return torch.einsum("ht,thd->hd", torch.softmax(logits, -1), vv)


@pytest.fixture(
    params=[
        (D, "kv_head", False, False),
        (32, "kv_head", False, False),
        (D, "layer", False, False),
        (D, "kv_head", True, False),
        (D, "kv_head", True, True),
        (32, "layer", True, True),
    ],
    ids=["group=d", "group=32", "granularity=layer", "feedback", "rope-mean", "rope-mean-layer-group=32"],
)
def setup(request, tmp_path):
    gs, granularity, feedback, rope = request.param
    rotations = _random_rotations(tmp_path, gs, granularity, feedback, rope)
    assert rotations.format_version == ("3" if rope else "2" if feedback else "1")
    g = torch.Generator().manual_seed(11)
    T = SINK + RECENT + 37  # INT2 middle of 37 tokens, crossing a page boundary below
    k = torch.randn(T, H_KV, D, generator=g) * 2
    v = torch.randn(T, H_KV, D, generator=g)
    q = torch.randn(H_Q, D, generator=g)
    layer = rotations.for_layer(1)
    mid = slice(SINK, T - RECENT)
    k_ref, v_ref = k.double().clone(), v.double().clone()
    k_ref[mid] = _contract_fake_quant(
        k[mid], layer.k_rotation, layer.k_mean, layer.k_clip, gs, layer.k_feedback,
        layer.k_rope_mean, torch.arange(SINK, T - RECENT),
    )  # fmt: skip
    v_ref[mid] = _contract_fake_quant(v[mid], layer.v_rotation, None, layer.v_clip, gs, layer.v_feedback)
    return rotations, gs, q, k, v, k_ref, v_ref


def test_calib_scheme_matches_contract(setup):
    from oscar_calib.schemes import SchemeContext

    rotations, gs, q, k, v, k_ref, v_ref = setup
    scheme = available_schemes()["oscar2"].factory(
        SchemeContext(head_dim=D, num_layers=LAYERS, num_kv_heads=H_KV, rotations=rotations)
    )
    mid = slice(SINK, k.shape[0] - RECENT)
    k_hat = scheme.fake_quantize_keys_at(1, k[mid].float(), torch.arange(SINK, k.shape[0] - RECENT))
    v_hat = scheme.fake_quantize_values(1, v[mid].float())
    assert ((k_hat.double() - k_ref[mid]).norm() / k_ref[mid].norm()).item() < 1e-4
    assert ((v_hat.double() - v_ref[mid]).norm() / v_ref[mid].norm()).item() < 1e-4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernels_paged_cache_matches_contract(setup, backend):
    import oscar_kernels as ok

    if backend == "triton" and not ok.triton_available():
        pytest.skip("triton is not installed (the e2e session installs it)")
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by the e2e nox session)")
    rotations, gs, q, k, v, k_ref, v_ref = setup
    params = ok.LayerQuantParams.from_rotations(rotations, 1)
    T = k.shape[0]
    layout = ok.CacheLayout(
        num_kv_heads=H_KV, head_dim=D, page_size=16, group_size=gs, sink_tokens=SINK, recent_tokens=RECENT
    )
    cache = ok.allocate_cache(layout, num_pages=8, max_seqs=2)
    pages = torch.tensor([5, 2, 7, 0, 3], dtype=torch.int32)  # scattered pages
    pos = torch.arange(T)
    slots = (pages[pos // 16] * 16 + pos % 16).long()
    seq_lens = torch.tensor([T], dtype=torch.int32)
    window_slots = torch.tensor([1], dtype=torch.int32)
    ok.paged_write(
        cache, params, k, v, slots, pos, torch.zeros(T, dtype=torch.long), seq_lens, window_slots,
        backend=backend,
    )  # fmt: skip
    out = ok.decode_attention(
        q[None], cache, params, pages[None], seq_lens, window_slots, backend=backend
    )[0]  # fmt: skip
    ref = _attend(q, k_ref, v_ref)
    exact = _attend(q, k, v)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    # bf16 windows and bf16 dots inside the kernel; INT2 error itself is far larger:
    assert err < 2e-2, err
    assert err < 0.5 * ((exact - ref).norm() / ref.norm()).item()
