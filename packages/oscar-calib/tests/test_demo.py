"""``oscar demo`` end to end on SmolLM2, shrunk to about a minute."""

from __future__ import annotations

import json

from conftest import needs_smollm2


@needs_smollm2
def test_demo_smollm2_small(tmp_path, monkeypatch, capsys):
    from oscar_calib.cli import main
    from oscar_calib.commands import demo

    monkeypatch.setattr(demo, "DEMO_CALIBRATION", {"tokens": 512, "seq_len": 512, "granularity": "kv_head"})
    # the demo's own settings, shrunk in length only: the same schemes, no passkey table
    small = {**demo.DEMO_EVAL, "contexts": (400,), "num_sequences": 1, "sink": 16, "recent": 64}
    monkeypatch.setattr(demo, "DEMO_EVAL", small)
    assert main(["demo", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "[demo] total" in out and "KV MiB" in out and "passkey retrieval" not in out
    for name in ("bf16", "int2", "kivi2", "hadamard2", "oscar2"):
        assert f"\n{name} " in out
    assert f"oscar eval smollm2 --rotations {tmp_path}/rotations.safetensors" in out
    # progress: one line per scheme and sequence with the time left (reference, 4 schemes, metrics)
    steps = [ln for ln in captured.err.splitlines() if ln.startswith("oscar eval: context 400, sequence 1/1")]
    assert [ln.split(": ")[1].split(",")[-1].strip() for ln in steps[:6]] == [
        "reference", "int2", "kivi2", "hadamard2", "oscar2", "metrics"
    ]  # fmt: skip
    assert steps[5].endswith("[step 6/6, ~0 s left]")
    result = json.loads((tmp_path / "results.json").read_text())
    block = result["contexts"]["400"]
    assert block["bf16"]["kl"]["mean"] == 0
    kl = {name: block[name]["kl"]["mean"] for name in ("int2", "kivi2", "hadamard2", "oscar2")}
    for value in kl.values():
        assert 0 < value < 5
    # The headline claim: oscar2 beats naive INT2 and Hadamard-only INT2 at the same bits.
    # Measured in this configuration (one 400-token sequence, 2 shared CPU cores): KL
    # oscar2 0.023, hadamard2 0.25 (11x), int2 1.33 (58x). The full demo's two 2k
    # sequences (docs/img/demo-smollm2.json) give oscar2 0.026 +- 0.015 (std over
    # sequences, the widest spread of the three), hadamard2 0.319 +- 0.002, int2
    # 1.18 +- 0.08: even the worse sequence keeps hadamard2 / oscar2 near 9x. The
    # margins below (3x and 10x) fail only if oscar2 loses over two thirds of its lead.
    assert kl["oscar2"] * 3 < kl["hadamard2"], kl
    assert kl["oscar2"] * 10 < kl["int2"], kl
    assert block["oscar2"]["bits_per_element"] == block["hadamard2"]["bits_per_element"]
    assert (tmp_path / "results.png").stat().st_size > 10_000
    assert (tmp_path / "rotations.safetensors").exists()
