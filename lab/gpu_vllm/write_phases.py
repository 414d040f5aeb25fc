"""Issue #38: where a decode write's ~40 µs go, phase by phase (one GPU call, ~1 min).

The one-token write of ``kernel_speed.py``'s ``write_case`` (Qwen3-8B KV shape, key error feedback
and the pre-RoPE mean: the default artifact's write) launched with ``paged_write_kv_kernel``'s
``PROBE`` build: each program stamps the GPU's nanosecond timer at the start, after the rotation,
the feedback staging (the last row chunk's read-back), the group statistics, each feedback quarter and
the end (a chunked write: the last chunk's phases). Prints, per token
count, the median over programs and repetitions of each phase (key programs with feedback, value
programs without) and the whole program, and writes ``$OUT/write_phases.json``.

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python3 lab/gpu_vllm/write_phases.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kernel_speed as KS  # noqa: E402

import oscar_kernels as ok  # noqa: E402
from oscar_kernels import launch as L  # noqa: E402
from oscar_kernels.kernels.paged_write import paged_write_kv_kernel  # noqa: E402

PHASES = ("rotation", "staging", "group stats", "quarter 0", "quarter 1", "quarter 2", "quarter 3", "stores")


def probed(n: int, reps: int = 20) -> dict:
    """Phase medians (µs) over ``reps`` eager ``n``-token writes (after one that compiles), each
    launched with ``PROBE`` and its own probe buffer."""
    cache, params, plan, args = KS.write_setup(n)
    stamps = []
    real = L.launch

    def spy(kernel, grid, *a, **kw):
        if kernel is paged_write_kv_kernel:
            buf = torch.zeros(grid[0] * grid[1], 16, dtype=torch.int64, device="cuda")
            stamps.append((buf, grid))
            return kernel[grid](*a, **dict(kw, probe_ptr=buf, PROBE=True))
        return real(kernel, grid, *a, **kw)

    mod = sys.modules["oscar_kernels.paged_write"]
    mod.launch = spy  # the write module's launches (it imported the name)
    try:
        for _ in range(reps + 1):
            ok.run_write(plan, cache, params, *args)
            torch.cuda.synchronize()
    finally:
        mod.launch = real
    out = {"tokens": n, "launches": len(stamps), "grid": list(stamps[0][1])}
    heads = stamps[0][1][1]  # K heads, then V heads
    per = torch.stack([b.cpu() for b, _ in stamps[1:]]).view(-1, stamps[0][1][0], heads, 16)
    for name, sel in (("key (feedback)", slice(0, heads // 2)), ("value", slice(heads // 2, heads))):
        t = per[:, :, sel].reshape(-1, 16).double()
        d = {}
        prev = t[:, 0]
        for i, ph in enumerate(PHASES, start=1):
            slot = 8 if ph == "stores" else i
            have = t[:, slot] > 0
            if have.any():
                d[ph] = round(float((t[have, slot] - prev[have]).median()) / 1e3, 2)
                prev = torch.where(have, t[:, slot], prev)
        d["whole program"] = round(float((t[:, 8] - t[:, 0]).median()) / 1e3, 2)
        out[name] = d
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"meta": KS.run_meta(), "oscar_kernels": os.path.dirname(ok.__file__), "phases": []}
    for n in (1, 8, 64):
        r = probed(n)
        res["phases"].append(r)
        print(json.dumps(r), flush=True)
    with open(os.path.join(a.out, "write_phases.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
