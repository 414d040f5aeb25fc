"""Time ``oscar calibrate`` on CPU or GPU: wall and CPU time, tokens/s, peak memory.

    python packages/oscar-calib/benchmarks/calibrate_speed.py --tokens 16384 --out new.safetensors
    python packages/oscar-calib/benchmarks/calibrate_speed.py --tokens 2048 --compare old.safetensors

Prints one JSON line. CPU time is the process's user+system time (all threads): on a
shared machine it is steadier than wall time. ``--compare`` reports the largest
difference to another artifact of the same model (float noise expected).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch


def _max_diff(a, b) -> dict[str, float]:
    out = {}
    for name in ("k_rotation", "v_rotation", "k_eigenvalues", "v_eigenvalues", "k_clip", "v_clip", "k_mean"):
        xs, ys = getattr(a, name), getattr(b, name)
        if xs is None or ys is None:
            continue
        out[name] = max(float((x.double() - y.double()).abs().max()) for x, y in zip(xs, ys, strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", help="write the artifact here")
    parser.add_argument("--compare", help="artifact to compare against")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from oscar_calib.calibrate import CalibrationConfig, calibrate
    from oscar_calib.models import load_model
    from oscar_math.artifact import load_rotations, save_rotations

    model, tok = load_model(args.model, device=args.device)
    config = CalibrationConfig(tokens=args.tokens, seq_len=args.seq_len)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    wall, cpu = time.perf_counter(), time.process_time()
    rot = calibrate(model, tok, config, model_name=args.model, progress=False)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    report = {
        "model": args.model,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "tokens": rot.calibration["tokens"],
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "tokens_per_s": round(rot.calibration["tokens"] / wall, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    if args.device.startswith("cuda"):
        report["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
    if args.out:
        save_rotations(args.out, rot)
    if args.compare:
        report["max_abs_diff"] = _max_diff(rot, load_rotations(args.compare))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
