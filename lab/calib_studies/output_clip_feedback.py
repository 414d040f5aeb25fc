"""Info only: --clip-search output (now scored with the served feedback codes) vs the default row
search, and vs the output search scored with plain rounding (the old behaviour), by KL on the
calibration split at 2k (seed 1234, 2 sequences; not the search's seed+1 sequences). CPU,
about 12 minutes on 2 cores; prints JSON::

    OSCAR_CACHE_DIR=... python lab/calib_studies/output_clip_feedback.py > result.json
"""

import dataclasses
import json
import sys
import time

import torch

from oscar_calib.calibrate import (
    CalibrationConfig,
    calibration_chunks,
    refine_clip_by_output,
    rotations_from_statistics,
)
from oscar_calib.capture import collect_statistics
from oscar_calib.models import load_model
from oscar_calib.power_search import _references, mean_kl
from oscar_calib.simulate import Windows
from oscar_calib.text import load_text, split_text, token_chunks

torch.set_num_threads(2)
t0 = time.perf_counter()
model, tok = load_model("smollm2")
cfg = CalibrationConfig(search_context=2048, search_seqs=2)
chunks, _ = calibration_chunks(tok, cfg)
stats = collect_statistics(
    model, chunks, sink=cfg.sink, max_samples=cfg.max_samples, seed=cfg.seed, progress=False
)
row = rotations_from_statistics(stats, cfg, model="smollm2")
print(f"row artifact {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
out_fb = refine_clip_by_output(model, tok, row, cfg)
print(f"output search (feedback) {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
# old behaviour: the search sees no feedback matrices (plain rounding), the artifact keeps them
plain_in = dataclasses.replace(row, k_feedback=None)
out_pl = refine_clip_by_output(model, tok, plain_in, cfg)
out_pl = dataclasses.replace(out_pl, k_feedback=row.k_feedback)
print(f"output search (plain) {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
cal_text, _ = split_text(load_text(None), cfg.heldout_fraction)
seqs = token_chunks(tok, cal_text, 2048, 2 * 2048, 1234)
refs = _references(model, seqs)
w = Windows(cfg.sink, cfg.recent)
res = {}
for name, rot in (
    ("row (default)", row),
    ("output, feedback-scored", out_fb),
    ("output, plain-scored (old)", out_pl),
):
    res[name] = mean_kl(model, rot, refs, w)
    print(f"{name}: KL {res[name]:.5f}  ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
meta = {k: v.calibration.get("output_error_ratio") for k, v in (("fb", out_fb), ("plain", out_pl))}
print(
    json.dumps({"kl": res, "output_error_ratio": meta, "seconds": round(time.perf_counter() - t0)}, indent=1)
)
