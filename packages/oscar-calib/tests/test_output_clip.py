"""The output clip search: its objective is the harness's mixed attention, it never ends worse
than its start, and calibrate() stores what it chose."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oscar_calib.calibrate import CalibrationConfig, calibrate, calibration_chunks, rotations_from_statistics
from oscar_calib.capture import collect_statistics
from oscar_calib.models import tiny_random_model
from oscar_calib.output_clip import (
    LayerCapture,
    _HeadProblem,
    capture_layers,
    output_metrics,
    search_output_clip,
)
from oscar_calib.schemes import SchemeContext, build_scheme
from oscar_calib.simulate import Windows, mixed_attention
from oscar_math.errors import OscarError

SMALL = dict(tokens=512, seq_len=128, sink=8, recent=16, max_samples=256, search_context=256, search_seqs=1)


@pytest.fixture(scope="module")
def llama():
    return tiny_random_model("llama", num_hidden_layers=2)


def test_head_problem_output_is_the_harness_mixed_attention():
    """Rows read quantised K/V exactly where oscar eval's mixed_attention does (windows included)."""
    torch.manual_seed(0)
    s, h_q, h_kv, d, sink, recent = 96, 4, 2, 16, 5, 7
    q = torch.randn(h_q, s, d)
    k, v = torch.randn(h_kv, s, d), torch.randn(h_kv, s, d)
    k_hat, v_hat = k + 0.3 * torch.randn_like(k), v + 0.3 * torch.randn_like(v)
    pos = torch.arange(3, s, 5)
    cap = LayerCapture(q[:, pos].transpose(0, 1), pos, k.transpose(0, 1), v.transpose(0, 1), 0.25)
    ref = mixed_attention(
        q[None], k[None], v[None], k_hat[None], v_hat[None], 0.25, Windows(sink, recent)
    )  # [1, S, H_q, d]
    for head in range(h_kv):
        pr = _HeadProblem(cap, head, h_q // h_kv, sink, recent, block=4)  # several causal blocks
        got = pr.output(pr.probs(k_hat[head]), v_hat[head])  # [g, R, d]
        want = ref[0, pos, head * 2 : head * 2 + 2].transpose(0, 1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # with exact K/V the mixed output is the exact one
        torch.testing.assert_close(pr.output(pr.probs(k[head]), v[head]), pr.out, atol=1e-5, rtol=1e-5)


def test_search_never_worse_than_start_and_picks_from_grid(llama):
    model, tok = llama
    config = CalibrationConfig(**SMALL, clip_search="row")
    chunks, _ = calibration_chunks(tok, config)
    stats = collect_statistics(
        model, chunks, sink=config.sink, max_samples=config.max_samples, progress=False
    )
    start = rotations_from_statistics(stats, config, model="m")
    seqs = [c for c in calibration_chunks(tok, dataclasses.replace(config, seq_len=256, tokens=512))[0]]
    caps = capture_layers(model, seqs, first_row=24, row_stride=4)
    assert caps[0][0].q_pos[0] == 24 and caps[0][0].key.shape == (256, 2, 32)
    metrics = output_metrics(model, 4, 32)
    grid = (0.5, 0.7, 0.9)
    res = search_output_clip(caps, metrics, start, sink=8, recent=16, grid=grid)
    for chosen, begun in zip(res.error_chosen, res.error_start, strict=True):
        assert chosen <= begun + 1e-12
    assert sum(res.error_chosen) < sum(res.error_start)  # the search must find something here
    allowed = {round(g + e, 4) for g in (*grid, 1.0) for e in (-0.05, 0.0, 0.05)}
    for i in range(start.num_layers):
        for new, old in zip(res.k_clip[i].tolist(), start.k_clip[i].tolist(), strict=True):
            assert round(new, 6) in allowed or new == pytest.approx(old)
    # keys only: values keep their start ratios
    k_only = search_output_clip(caps, metrics, start, sink=8, recent=16, grid=grid, search_values=False)
    for a, b in zip(k_only.v_clip, start.v_clip, strict=True):
        torch.testing.assert_close(a, b.float())
    # no search: the chosen error is the start error, the ratios are the start ratios
    none = search_output_clip(
        caps, metrics, start, sink=8, recent=16, grid=grid, search_keys=False, search_values=False
    )
    assert none.error_chosen == none.error_start
    # the metric is o_proj's: doubling o_proj's weights multiplies the error by 4
    m2 = [4 * m for m in metrics]
    twice = search_output_clip(
        caps, m2, start, sink=8, recent=16, grid=grid, search_keys=False, search_values=False
    )
    assert twice.error_start[0] == pytest.approx(4 * none.error_start[0], rel=1e-5)


def test_search_scores_the_served_error_feedback_codes(llama):
    """With k_feedback/v_feedback in the artifact the objective is the attention-output error of
    the codes engines serve (oscar2: feedback rounding), not of plain rounding, which differs."""
    model, tok = llama
    config = CalibrationConfig(**SMALL, feedback="kv")
    chunks, _ = calibration_chunks(tok, config)
    stats = collect_statistics(
        model, chunks, sink=config.sink, max_samples=config.max_samples, progress=False
    )
    start = rotations_from_statistics(stats, config, model="m")
    assert start.k_feedback is not None and start.v_feedback is not None
    torch.manual_seed(0)
    n, s, h_q, h_kv, d, windows, scaling = start.num_layers, 96, 4, 2, 32, Windows(5, 7), 32**-0.5
    q, k, v = (torch.randn(n, h, s, d) for h in (h_q, h_kv, h_kv))
    k = k + 2.0 * torch.randn(n, h_kv, 1, d)  # an offset for the key mean to matter
    pos = torch.arange(12, s, 3)
    rows = [(q[i][:, pos].transpose(0, 1), pos, k[i].transpose(0, 1), v[i].transpose(0, 1)) for i in range(n)]
    caps = [[LayerCapture(*r, scaling) for r in rows]]
    a = torch.randn(n, h_q, d, d)
    metrics = list(a @ a.transpose(-1, -2) / d)

    def served(rot, scheme: str) -> list[float]:
        """Σ_rows Σ_h e M_h e of the harness's mixed attention with ``scheme``'s fake-quantised K/V."""
        sch = build_scheme(scheme, SchemeContext(d, n, h_kv, rot))
        out = []
        for i in range(n):
            k_hat = sch.fake_quantize_keys(i, k[i].transpose(0, 1)).transpose(0, 1)
            v_hat = sch.fake_quantize_values(i, v[i].transpose(0, 1)).transpose(0, 1)
            qkv = (q[i][None], k[i][None], v[i][None])
            mixed = mixed_attention(*qkv, k_hat[None], v_hat[None], scaling, windows)
            exact = mixed_attention(*qkv, k[i][None], v[i][None], scaling, windows)
            err = (mixed - exact)[0, pos]  # [R, H_q, d]
            out.append(float(torch.einsum("rhd,hde,rhe->", err, metrics[i], err)))
        return out

    kw = dict(sink=windows.sink, recent=windows.recent, grid=(0.5, 0.7, 0.9))
    none = search_output_clip(caps, metrics, start, **kw, search_keys=False, search_values=False)
    fb, plain = served(start, "oscar2"), served(start, "oscar2-nofeedback")
    assert none.error_start == pytest.approx(fb, rel=1e-4)
    for f, p in zip(fb, plain, strict=True):  # plain rounding would score something else
        assert abs(f - p) > 1e-2 * f
    assert none.error_unclipped == pytest.approx(served(start, "oscar2-noclip"), rel=1e-4)
    # the chosen ratios' objective is the served error of the artifact storing them
    res = search_output_clip(caps, metrics, start, **kw)
    chosen = dataclasses.replace(start, k_clip=tuple(res.k_clip), v_clip=tuple(res.v_clip))
    assert res.error_chosen == pytest.approx(served(chosen, "oscar2"), rel=1e-4)
    assert sum(res.error_chosen) < sum(res.error_start)


def test_calibrate_stores_the_output_search(llama, tmp_path):
    model, tok = llama
    assert CalibrationConfig().clip_search == "row"  # the output search measured worse end to end
    out = calibrate(model, tok, CalibrationConfig(**SMALL, clip_search="output"), progress=False)
    row = calibrate(model, tok, CalibrationConfig(**SMALL), progress=False)
    meta = out.calibration
    assert meta["clip_search"]["tokens_per_sequence"] == 256 and meta["clip_search"]["sequences"] == 1
    assert "clip_power" not in meta and meta["row_clip_power"] == {"k": 0.5, "v": 0.5}  # feedback default
    assert meta["output_error_ratio"]["chosen_vs_row_search"] <= 1.0
    assert row.calibration["clip_power"] == 0.5  # key power with error-feedback codes (the default)
    # same rotations and mean, other clip ratios
    for a, b in zip(out.k_rotation, row.k_rotation, strict=True):
        torch.testing.assert_close(a, b)
    assert any(not torch.allclose(a.float(), b.float()) for a, b in zip(out.k_clip, row.k_clip, strict=True))
    # deterministic
    again = calibrate(model, tok, CalibrationConfig(**SMALL, clip_search="output"), progress=False)
    for a, b in zip((*out.k_clip, *out.v_clip), (*again.k_clip, *again.v_clip), strict=True):
        assert torch.equal(a, b)


def test_clip_search_config_checked():
    with pytest.raises(OscarError, match="clip_search"):
        CalibrationConfig(clip_search="both")
    with pytest.raises(OscarError, match="search_seqs"):
        CalibrationConfig(search_seqs=0)


def test_gradient_capture_is_the_loss_gradient_at_the_rows(llama):
    """gradients=True keeps d(loss)/d(attention output) at the strided rows: moving one row's
    output along it changes the loss by about |g|² · step (checked through a real forward)."""
    model, tok = llama
    ids = torch.arange(64) % 50 + 40
    caps = capture_layers(model, [ids], first_row=10, row_stride=9, gradients=True)
    plain = capture_layers(model, [ids], first_row=10, row_stride=9)
    assert plain[0][1].grad is None
    g = caps[0][1].grad  # [R, H_q, d]
    assert g.shape == (len(caps[0][1].q_pos), 4, 32) and float(g.abs().sum()) > 0
    torch.testing.assert_close(caps[0][1].key, plain[0][1].key)
    row, pos = 2, int(caps[0][1].q_pos[2])
    step = 1e-3

    from oscar_calib.attention import attention_override, sdpa_attention

    def loss(shift: float) -> float:
        def hook(ctx, query, key, value, mask, scaling, **kw):
            o = sdpa_attention(query, key, value, mask, scaling)
            if ctx.layer_idx == 1:
                o = o.clone()
                o[0, pos] += shift * g[row]
            return o

        with torch.no_grad(), attention_override(model, hook):
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
        return float(torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum"))

    change = (loss(step) - loss(-step)) / (2 * step)
    assert change == pytest.approx(float(g[row].square().sum()), rel=2e-2)
