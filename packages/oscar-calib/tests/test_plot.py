"""The evaluation figure."""

from __future__ import annotations

from oscar_calib.plot import plot_result


def _summary(mean, std=0.1):
    return {"mean": mean, "std": std, "ci_low": mean - std, "ci_high": mean + std, "n": 2}


def test_plot_writes_png(tmp_path):
    block = {
        "bf16": {"bits_per_element": 16.0, "sequences": 2, "perplexity": _summary(10), "kl": _summary(0, 0)},
        "int2": {
            "bits_per_element": 4.6,
            "sequences": 2,
            "perplexity": _summary(40, 5),
            "kl": _summary(1.0),
            "logit_error": [0.5, 0.7, 0.9],
            "output_error": [0.3, 0.4, 0.2],
        },
        "oscar2": {
            "bits_per_element": 4.6,
            "sequences": 2,
            "perplexity": _summary(12, 1),
            "kl": _summary(0.1),
            "logit_error": [0.1, 0.2, 0.15],
            "output_error": [0.05, 0.1, 0.07],
        },
    }
    result = {"model": "m", "config": {"sink": 64, "recent": 256}, "contexts": {"512": block, "1024": block}}
    out = plot_result(result, tmp_path / "sub" / "fig.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert plot_result(result, tmp_path / "f2.png", context=512).exists()
    # no suffix: matplotlib appends .png, and the returned path says so (the CLI prints it)
    assert plot_result(result, tmp_path / "adir") == tmp_path / "adir.png"
    assert (tmp_path / "adir.png").is_file() and not (tmp_path / "adir").exists()
