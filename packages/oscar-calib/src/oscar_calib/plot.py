"""Figure of an evaluation: per-layer errors and metrics per scheme (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_result"]


def plot_result(result: Any, path: str | Path, context: str | int | None = None) -> Path:
    """Write a PNG with four panels (two without per-layer errors) for one context length
    (default: the largest).

    Top, when the result holds per-layer errors: relative attention-logit error and output
    error per layer, one line per scheme. Bottom: the paired perplexity increase over BF16
    (or the perplexity when there is no BF16 reference) and KL(BF16 ‖ scheme) per scheme,
    bars with the std over sequences as error bars.

    Args:
        result: :class:`oscar_calib.evaluate.EvalResult` or its dict.
        path: output ``.png``.
        context: which context's numbers to plot.
    Returns:
        the written path.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    r = result.to_dict() if hasattr(result, "to_dict") else result
    ctxs = list(r["contexts"])
    key = str(context) if context is not None else max(ctxs, key=int)
    block = r["contexts"][key]
    names = list(block)
    # the per-layer panels only when errors were captured (``oscar demo`` captures none)
    layer_panels = any(block[n].get("logit_error") for n in names)
    rows = 2 if layer_panels else 1
    fig, axes = plt.subplots(rows, 2, figsize=(13, 4.25 * rows), squeeze=False)
    if layer_panels:
        for ax, metric, title in (
            (axes[0, 0], "logit_error", "attention-logit error (rel., per-query offset removed)"),
            (axes[0, 1], "output_error", "attention-output error (rel.)"),
        ):
            for name in names:
                ys = block[name].get(metric)
                if ys:
                    ax.plot(range(len(ys)), ys, marker="o", ms=3, label=name)
            ax.set_xlabel("layer")
            ax.set_title(title, fontsize=10)
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
        axes[0, 0].legend(fontsize=8, ncol=2)
    quant = [n for n in names if block[n]["bits_per_element"] < 16]
    ref = [n for n in names if block[n]["bits_per_element"] >= 16]
    paired = all("delta_ppl" in block[n] for n in quant)
    ppl_metric = "delta_ppl" if paired else "perplexity"
    ppl_title = (
        "perplexity increase over BF16, % (paired, mean ± std)" if paired else "perplexity (mean ± std)"
    )
    for ax, metric, title in (
        (axes[rows - 1, 0], ppl_metric, ppl_title),
        (axes[rows - 1, 1], "kl", "KL(BF16 ‖ scheme), nats/token (mean ± std)"),
    ):
        scale = 100.0 if metric == "delta_ppl" else 1.0
        means = [block[n][metric]["mean"] * scale for n in quant]
        stds = [block[n][metric]["std"] * scale for n in quant]
        bars = ax.bar(range(len(quant)), means, yerr=stds, capsize=3, color="tab:blue", alpha=0.8)
        for b, n in zip(bars, quant, strict=True):
            if n == "oscar2":
                b.set_color("tab:red")
        if metric == "delta_ppl":
            ax.axhline(5.0, ls=":", color="k", label="5% of BF16")
            ax.legend(fontsize=8)
        if metric == "perplexity" and ref:
            ax.axhline(block[ref[0]][metric]["mean"], ls="--", color="k", label=f"{ref[0]}")
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(quant)), quant, rotation=30, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    cfg = r["config"]
    n = block[names[0]]["sequences"]
    fig.suptitle(
        f"{r['model']}: context {key}, {n} held-out sequences, BF16 windows sink {cfg['sink']} / "
        f"recent {cfg['recent']}",
        fontsize=11,
    )
    fig.tight_layout()
    out = Path(path)
    if not out.suffix:  # matplotlib would append ".png" itself: return the name it writes
        out = out.with_name(out.name + ".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
