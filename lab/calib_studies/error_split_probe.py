"""Where the remaining error sits (issue 13, after study 6): keys-only and values-only INT2 of the
default artifact, and a static value mean (every value row centred by the calibration mean of the
values, added back to the attention output) — emulation only, every row against BF16 in one run.

::

    python lab/calib_studies/error_split_probe.py --out $OUT/split      # H200, ~2 min
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_context_run import score, table  # noqa: E402
from study_common import start_study  # noqa: E402

from oscar_calib.attention import attention_override  # noqa: E402
from oscar_calib.calibrate import CalibrationConfig, calibrate, calibration_chunks  # noqa: E402
from oscar_calib.models import load_model, model_name  # noqa: E402
from oscar_calib.schemes import KVScheme, SchemeContext, build_scheme  # noqa: E402
from oscar_calib.simulate import exact_attention  # noqa: E402
from oscar_calib.text import split_text, token_chunks  # noqa: E402

JSON = "error_split_probe.json"


class PartScheme(KVScheme):
    """``base`` on keys and/or values only (the other exact); value rows optionally centred by
    ``value_means`` (``[H_kv, d]`` per layer) before the base's value codec."""

    def __init__(self, name: str, base: Any, keys: bool = True, values: bool = True, value_means=None):
        self.name, self.base, self.keys, self.values, self.value_means = name, base, keys, values, value_means
        self._codecs: dict[int, Any] = {}

    def fake_quantize_keys(self, i: int, k: torch.Tensor) -> torch.Tensor:
        return self.base.fake_quantize_keys(i, k) if self.keys else k

    def fake_quantize_keys_at(self, i: int, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.base.fake_quantize_keys_at(i, k, positions) if self.keys else k

    def fake_quantize_values(self, i: int, v: torch.Tensor) -> torch.Tensor:
        if not self.values:
            return v
        if self.value_means is None:
            return self.base.fake_quantize_values(i, v)
        if i not in self._codecs:
            self._codecs[i] = dataclasses.replace(self.base.value_codec(i), mean=self.value_means[i])
        return self._codecs[i].fake_quantize(v).to(v.dtype)

    def bits_per_element(self, *a: Any) -> float:
        return self.base.bits_per_element(*a)


@torch.no_grad()
def value_means(model: Any, chunks: list[torch.Tensor], sink: int) -> list[torch.Tensor]:
    """Per layer ``[H_kv, d]`` float32 mean of the values at positions ``>= sink``."""
    sums: dict[int, torch.Tensor] = {}
    count = 0

    def fn(ctx: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float, **kw: Any) -> Any:
        sums[ctx.layer_idx] = sums.get(ctx.layer_idx, 0) + value[0, :, sink:].double().sum(1).cpu()
        return exact_attention(query, key, value, scaling, attention_mask)

    dev = next(model.parameters()).device
    with attention_override(model, fn):
        for c in chunks:
            model.get_decoder()(input_ids=c[None].to(dev), use_cache=False)
            count += c.numel() - sink
    return [(sums[i] / count).float() for i in range(len(sums))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="error-split")
    args = ap.parse_args(argv)
    st = start_study(args.out, "split")
    model16, tok = load_model("smollm2", dtype=torch.bfloat16, device=st.dev)
    model32 = load_model("smollm2", dtype=torch.float32, device=st.dev)[0]
    cfg = CalibrationConfig(text=str(st.text_path))  # the default artifact, as `oscar calibrate` makes it
    rot = calibrate(model32, tok, cfg, model_name=model_name("smollm2"), progress=False)
    base = build_scheme("oscar2", SchemeContext(rot.head_dim, rot.num_layers, rot.num_kv_heads, rot))
    cal_text, held = split_text(st.text)
    chunks, _ = calibration_chunks(tok, cfg)
    vm = value_means(model32, chunks, cfg.sink)
    schemes = {
        "default (K+V INT2)": base,
        "keys only (V exact)": PartScheme("k", base, values=False),
        "values only (K exact)": PartScheme("v", base, keys=False),
        "+ value mean": PartScheme("vm", base, value_means=vm),
        "+ value mean, values only": PartScheme("vmv", base, keys=False, value_means=vm),
    }
    st.report["rope_pairs"] = rot.calibration.get("rope_mean")
    for part, text, cs, ns, seed in (
        ("selection", cal_text, [2048, 8192], [4, 2], 1234),
        ("heldout", held, [2048, 4096, 8192], [8, 4, 2], 0),
        ("other", st.other, [2048, 8192], [4, 2], 0),
    ):
        st.report[part] = {}
        for c, n in zip(cs, ns, strict=True):
            t = time.perf_counter()
            res = score(model16, schemes, token_chunks(tok, text, c, c * n, seed), st.windows)
            st.report[part][str(c)] = res
            print(table(f"{part} {c} ({time.perf_counter() - t:.0f} s)", res), flush=True)
            st.dump(JSON)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
