"""collect_statistics: the streamed statistics equal brute-force computations on recorded q/k/v."""

from __future__ import annotations

import pytest
import torch

from oscar_calib.attention import attention_override, sdpa_attention
from oscar_calib.capture import _sample_positions, collect_statistics
from oscar_calib.models import tiny_random_model

SINK = 5


def _chunks(n: int, seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (seq_len,), generator=g) for _ in range(n)]


def _record(model, chunks):
    """Per layer, the list over chunks of (q [T,Hq,d], k [T,Hkv,d], v, scaling)."""
    out: dict[int, list] = {}

    def rec(ctx, q, k, v, mask, scaling, **kw):
        out.setdefault(ctx.layer_idx, []).append(
            (
                q[0].transpose(0, 1).double(),
                k[0].transpose(0, 1).double(),
                v[0].transpose(0, 1).double(),
                scaling,
            )
        )
        return sdpa_attention(q, k, v, mask, scaling)

    with torch.no_grad(), attention_override(model, rec):
        for c in chunks:
            model(c[None], use_cache=False)
    return out


@pytest.mark.parametrize(("family", "batch_size"), [("qwen3", 1), ("llama", 1), ("llama", 2)])
def test_statistics_match_brute_force(family, batch_size):
    model, _ = tiny_random_model(family, num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    chunks = _chunks(3, 41)
    stats = collect_statistics(
        model, chunks, sink=SINK, max_samples=50, seed=3, block_size=16, progress=False, batch_size=batch_size
    )
    recorded = _record(model, chunks)
    g = 3
    for layer, calls in recorded.items():
        q_rows = torch.cat([q[SINK:] for q, _, _, _ in calls])  # [N, Hq, d]
        c_q = torch.einsum("nhi,nhj->hij", q_rows, q_rows) / q_rows.shape[0]
        expected_cq = c_q.view(2, g, *c_q.shape[1:]).mean(1)
        torch.testing.assert_close(
            stats.query_cov[layer].result("kv_head"), expected_cq, rtol=1e-9, atol=1e-9
        )
        k_rows = torch.cat([k[SINK:] for _, k, _, _ in calls])
        torch.testing.assert_close(
            stats.key_mean[layer].result("kv_head"), k_rows.mean(0), rtol=1e-9, atol=1e-9
        )
        # C_S: second moment of attention outputs with the sink tokens' values zeroed
        outs, weights = [], []
        for q, k, v, scaling in calls:
            T = q.shape[0]
            kk, vv = k.repeat_interleave(g, 1), v.clone()
            vv[:SINK] = 0
            vv = vv.repeat_interleave(g, 1)
            logits = torch.einsum("thd,shd->hts", q, kk) * scaling
            logits = logits.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
            S = logits.softmax(-1)
            outs.append(torch.einsum("hts,shd->thd", S, vv))
            weights.append((S * S).sum(1).T.reshape(T, 2, g).sum(-1))  # [T, Hkv]
        o = torch.cat(outs)
        c_s = torch.einsum("thi,thj->hij", o, o) / o.shape[0]
        expected_cs = c_s.view(2, g, *c_s.shape[1:]).mean(1)
        torch.testing.assert_close(
            stats.value_cov[layer].result("kv_head"), expected_cs, rtol=1e-4, atol=1e-6
        )
        # samples are the raw rows at the seeded positions, with their S² weights
        positions = _sample_positions(len(chunks), 41, SINK, 50, 3)
        sample = stats.samples[layer]
        assert sample.keys.shape == (50, 2, model.config.head_dim)
        exp_k = torch.cat([calls[c][1][p] for c, p in enumerate(positions)]).float()
        exp_v = torch.cat([calls[c][2][p] for c, p in enumerate(positions)]).float()
        exp_w = torch.cat([weights[c][p] for c, p in enumerate(positions)]).float()
        torch.testing.assert_close(sample.keys, exp_k)
        torch.testing.assert_close(sample.values, exp_v)
        torch.testing.assert_close(sample.key_weights, exp_w, rtol=1e-4, atol=1e-6)
    assert stats.tokens == 3 * 41
    assert model.config._attn_implementation == "sdpa"


def test_sample_positions_seeded_bounded_and_past_sink():
    a = _sample_positions(4, 30, 6, 40, seed=1)
    b = _sample_positions(4, 30, 6, 40, seed=1)
    c = _sample_positions(4, 30, 6, 40, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    flat = torch.cat(a)
    assert flat.numel() == 40 and int(flat.min()) >= 6 and int(flat.max()) < 30
    assert all(torch.equal(p, p.unique()) for p in a)  # sorted, no repeats within a chunk
    # fewer candidate rows than asked for: take them all
    assert sum(p.numel() for p in _sample_positions(2, 10, 4, 1000, seed=0)) == 12


def test_rejects_bad_chunks():
    from oscar_math.errors import OscarError

    model, _ = tiny_random_model("llama")
    with pytest.raises(OscarError, match="seq_len"):
        collect_statistics(model, _chunks(1, 8), sink=8, progress=False)
    with pytest.raises(OscarError, match="chunks"):
        collect_statistics(
            model, [torch.zeros(20, dtype=torch.long), torch.zeros(21, dtype=torch.long)], sink=4
        )
    with pytest.raises(OscarError, match="chunks"):
        collect_statistics(model, [], sink=4)


def test_fast_capture_gives_the_reference_artifact(monkeypatch):
    """Fused C_S + sampled key weights + batching + no LM head == the reference machinery.

    The reference is the pre-optimisation path (blockwise softmax over all keys, one
    sequence per full-model forward): the artifact may differ only by float noise.
    """
    from oscar_calib import capture
    from oscar_calib.calibrate import CalibrationConfig, rotations_from_statistics

    model, _ = tiny_random_model("llama", num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    chunks = _chunks(4, 96, seed=5)
    config = CalibrationConfig(tokens=4 * 96, seq_len=96, sink=8, recent=16, max_samples=200)
    heads = []
    monkeypatch.setattr(capture, "_forward_without_head", lambda m: heads.append(1) or m)
    monkeypatch.setattr(capture, "_FUSED", False)
    ref_stats = collect_statistics(model, chunks, sink=8, max_samples=200, seed=0, progress=False)
    monkeypatch.undo()
    fast_stats = collect_statistics(
        model, chunks, sink=8, max_samples=200, seed=0, progress=False, batch_size=3
    )
    assert heads == [1]
    ref = rotations_from_statistics(ref_stats, config, model="m")
    fast = rotations_from_statistics(fast_stats, config, model="m")
    for name in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip", "k_mean"):
        for layer, (a, b) in enumerate(zip(getattr(fast, name), getattr(ref, name), strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"{name}[{layer}]")
