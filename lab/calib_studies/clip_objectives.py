"""Searched key clip ratios under the two key objectives, from one calibration pass.

Prints the layer mean of the searched (untempered, ``clip_power=1``) key clip ratios with
every sampled row weighted alike ("logit") and weighted by the attention its token receives
("attention"), for the ``oscar calibrate`` defaults otherwise (CPU, float32)::

    OSCAR_SMOLLM2_GGUF=... python lab/calib_studies/clip_objectives.py --tokens 16384
"""

from __future__ import annotations

import argparse
import dataclasses

from oscar_calib.calibrate import CalibrationConfig, calibration_chunks, rotations_from_statistics
from oscar_calib.capture import collect_statistics
from oscar_calib.models import load_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    model, tok = load_model("smollm2")
    # chunks of 1024: the CLI's default when the recorded numbers were measured
    config = CalibrationConfig(tokens=args.tokens, seq_len=1024, clip_power=1.0, value_clip_power=1.0)
    chunks, _ = calibration_chunks(tok, config)
    stats = collect_statistics(
        model, chunks, sink=config.sink, max_samples=config.max_samples, seed=config.seed, progress=False
    )
    for objective in ("logit", "attention"):
        rot = rotations_from_statistics(
            stats, dataclasses.replace(config, key_clip_objective=objective), model="smollm2"
        )
        k = sum(float(c.mean()) for c in rot.k_clip) / rot.num_layers
        per_layer = " ".join(f"{float(c.mean()):.2f}" for c in rot.k_clip)
        print(f"{objective:<10} K clip mean {k:.3f}   per layer: {per_layer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
