"""Evaluation harness and ``oscar eval`` on a tiny random llama."""

from __future__ import annotations

import json

import pytest

from oscar_calib.evaluate import EvalConfig, format_table, run_eval
from oscar_calib.models import tiny_random_model
from oscar_math import OscarError
from oscar_math.artifact import identity_rotations, save_rotations
from oscar_math.bits import bits_per_element

TEXT = " ".join(
    f"Paragraph {i}: the quick brown fox {i * 7 % 13} jumps over the lazy dog." for i in range(400)
)
SCHEMES = ("bf16", "int2", "kivi2", "hadamard2", "oscar2", "oscar2-noclip")


def _rot(layers=2):
    return identity_rotations("tiny", layers, 2, 32, k_clip=0.9, granularity="kv_head")


def test_config_validation():
    with pytest.raises(OscarError, match="schemes"):
        EvalConfig(schemes=("int2", "int2"))
    with pytest.raises(OscarError, match="num_sequences"):
        EvalConfig(num_sequences=0)
    with pytest.raises(OscarError, match="needle depth"):
        EvalConfig(needle_depths=(1.5,))
    with pytest.raises(OscarError, match="needle_schemes"):
        EvalConfig(schemes=("bf16",), needle_schemes=("oscar2",))
    assert EvalConfig(contexts=[512]).contexts == (512,)


def test_run_eval_tiny_model():
    model, tok = tiny_random_model("llama", seed=1)
    cfg = EvalConfig(
        contexts=(96, 160),
        schemes=SCHEMES,
        num_sequences=2,
        sink=4,
        recent=16,
        needle_contexts=(300,),
        needle_depths=(0.5,),
        needle_schemes=("bf16", "oscar2", "kivi2"),
    )
    res = run_eval(model, tok, _rot(), cfg, progress=False, model_name="tiny", heldout_text=TEXT)
    d = json.loads(res.to_json())
    block = d["contexts"]["160"]
    assert list(block) == list(SCHEMES)
    assert block["bf16"]["kl"]["mean"] == 0 and block["bf16"]["delta_ppl"]["mean"] == 0
    assert block["bf16"]["top1"]["mean"] == 1
    for name in SCHEMES[1:]:
        e = block[name]
        assert e["kl"]["mean"] > 0 and e["sequences"] == 2 and len(e["per_sequence"]["kl"]) == 2
        assert len(e["logit_error"]) == 2 and all(x > 0 for x in e["output_error"])
        assert e["kl"]["ci_low"] <= e["kl"]["mean"] <= e["kl"]["ci_high"]
    assert block["int2"]["bits_per_element"] == bits_per_element(160, 32, sink_tokens=4, recent_tokens=16)
    assert set(d["needle"]) == {"bf16", "oscar2", "kivi2"} and d["needle"]["oscar2"]["total"] == 1
    table = format_table(res)
    for name in SCHEMES:
        assert name in table
    assert "context 96 tokens" in table and "passkey" in table


def test_cli_eval_json_and_plot(tmp_path, monkeypatch, capsys):
    import oscar_calib.models as models
    from oscar_calib.cli import main

    monkeypatch.setattr(models, "load_model", lambda name, **kw: tiny_random_model("llama", seed=2))
    rot = save_rotations(tmp_path / "rot.safetensors", _rot())
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(TEXT[i : i + 300] for i in range(0, len(TEXT), 300)))
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    code = main(
        [
            "eval",
            "tiny",
            "--rotations",
            str(rot),
            "--text",
            str(text),
            "--context",
            "80",
            "--schemes",
            "bf16",
            "int2",
            "oscar2",
            "--num-seqs",
            "2",
            "--sink",
            "4",
            "--recent",
            "8",
            "--needle-context",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
            "--quiet",
        ]
    )
    assert code == 0
    got = capsys.readouterr().out
    assert "oscar2" in got and "context 80 tokens" in got
    assert json.loads(out_json.read_text())["contexts"]["80"]["oscar2"]["kl"]["mean"] > 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_eval_rejects_mismatched_rotations(tmp_path, monkeypatch, capsys):
    import oscar_calib.models as models
    from oscar_calib.cli import main

    monkeypatch.setattr(models, "load_model", lambda name, **kw: tiny_random_model("llama", seed=2))
    rot = save_rotations(tmp_path / "rot.safetensors", _rot(layers=5))
    assert main(["eval", "tiny", "--rotations", str(rot), "--quiet"]) == 2
    assert "num_layers" in capsys.readouterr().err


def test_progress_lines_time_left_and_memory_column(capsys):
    model, tok = tiny_random_model("llama", seed=3)  # 2 layers, 2 KV heads, d = 32
    cfg = EvalConfig(
        contexts=(64, 96),
        schemes=("bf16", "int2", "oscar2"),
        num_sequences=2,
        sink=4,
        recent=8,
        error_sequences=0,
        needle_contexts=(260,),
        needle_depths=(0.5,),
        needle_schemes=("bf16", "oscar2"),
    )
    res = run_eval(model, tok, _rot(), cfg, progress=True, model_name="tiny", heldout_text=TEXT)
    steps = [ln for ln in capsys.readouterr().err.splitlines() if "[step " in ln]
    # per context and sequence: reference, int2, oscar2, metrics; then one passkey step per scheme
    total = 2 * 2 * 4 + 2
    assert [ln.split("[step ")[1].split("/")[0] for ln in steps] == [str(i) for i in range(1, total + 1)]
    assert all(f"/{total}," in ln for ln in steps)
    assert "context 96, sequence 2/2, oscar2:" in steps[14] and "passkey oscar2: " in steps[-1]
    # known from the first step on: metrics and passkey steps stand in with the forward rate
    assert all(" left]" in ln for ln in steps) and steps[-1].endswith("~0 s left]")
    block = res.to_dict()["contexts"]["96"]
    for name in ("bf16", "int2", "oscar2"):  # K and V, 2 layers x 2 KV heads x 32 x 96 tokens
        assert block[name]["kv_mib"] == block[name]["bits_per_element"] * 2 * 2 * 2 * 32 * 96 / 8 / 2**20
    table = format_table(res)
    assert "KV MiB" in table and "logit err" not in table  # no per-layer errors were captured
    assert f"{block['oscar2']['kv_mib']:.1f}" in table.split("context 96")[1]


def test_plan_keys_separate_the_sequences_with_error_capture():
    # the time-left estimate reuses a step's last time only for the same key: a pass that
    # captures per-layer errors (~2x slower) must not stand in for one that does not
    from types import SimpleNamespace

    from oscar_calib.evaluate import _plan

    cfg = EvalConfig(contexts=(64,), schemes=("bf16", "int2"), num_sequences=2, error_sequences=1)
    schemes = {"bf16": SimpleNamespace(quantized=False), "int2": SimpleNamespace(quantized=True)}
    plan = _plan(cfg, schemes, {64: 2}, [])
    assert [(s.kind, s.key) for s in plan] == [
        ("forward", "reference"), ("forward", ("int2", True)), ("metrics", 2),
        ("forward", "reference"), ("forward", ("int2", False)), ("metrics", 2),
    ]  # fmt: skip
    assert plan[2].size == 64 * 2 and plan[2].like == "forward"
