"""The OSCAR vLLM backend's per-step calls on a GPU, without vLLM.

vLLM cannot be installed on the H200 test machine, so this script plays vLLM's part: it
allocates each layer's KV tensor the way vLLM does (``[num_blocks, page_bytes]`` bytes,
garbage-filled), schedules requests like vLLM's scheduler (chunked prefill, mixed
decode + prefill batches, blocks handed out in random order, ``-1`` padding slots),
builds the step metadata with the backend's own :func:`oscar_vllm.step.build_step`
(window slots from the V1-runner table or from V2-runner request rows) and runs the
backend's :func:`~oscar_vllm.step.write_step` / :func:`~oscar_vllm.step.attend_step`
with the Triton kernels. Every step it checks:

* the write: the Triton-written INT2 codes against a torch-reference write into a CPU
  copy (fraction of differing code bytes; tf32 rotation flips ~0.2 %), and the BF16 windows;
* the attention: Triton output against the torch reference run over a CPU snapshot of
  the same (Triton-written) cache: relative error < 1e-2.

    python packages/oscar-vllm/benchmarks/gpu_check.py [--out results.json]           # CUDA
    TRITON_INTERPRET=1 python packages/oscar-vllm/benchmarks/gpu_check.py --reduced    # CPU, small

Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from dataclasses import dataclass, replace

import torch

try:
    import oscar_vllm  # noqa: F401
except ImportError:  # the GPU machine installs math/kernels only: use this checkout's source
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "src"))

from oscar_kernels import CacheLayout, LayerQuantParams, cache_from_page_buffer, page_bytes
from oscar_vllm.settings import shard_kv_heads, shard_params
from oscar_vllm.step import WindowSlots, attend_step, build_step, write_step


@dataclass
class Case:
    name: str
    h_kv: int
    gqa: int
    d: int
    page: int
    group: int
    sink: int
    recent: int
    prompts: tuple[int, ...]
    decode_steps: int
    chunk: int  # max tokens per step (vLLM's max_num_batched_tokens)
    granularity: str = "kv_head"
    v2_rows: bool = False  # window slots from request rows (V2 runner) instead of the block table
    tp: tuple[int, int] = (1, 0)  # (tensor-parallel size, rank): the rank's heads of a 2x-head artifact


CASES = [
    Case("mixed-128", 8, 4, 128, 64, 128, 64, 256, (1, 70, 321, 1000, 2100), 6, 512),
    Case("smollm2-shape", 3, 3, 64, 16, 64, 64, 256, (5, 300, 777), 5, 256, v2_rows=True),
    Case("g32-layer", 4, 2, 128, 32, 32, 64, 256, (400, 33), 4, 128, granularity="layer"),
    Case("tp2-rank1", 4, 4, 128, 64, 128, 64, 256, (900, 64), 4, 256, tp=(2, 1)),
]
REDUCED = [
    Case("reduced-mixed", 2, 2, 32, 16, 32, 8, 16, (3, 30, 45), 3, 24),
    Case("reduced-v2-layer", 2, 3, 32, 8, 16, 4, 12, (20, 9), 2, 16, granularity="layer", v2_rows=True),
    Case("reduced-tp", 2, 2, 32, 16, 32, 8, 16, (40, 5), 2, 16, tp=(2, 1)),
]


def _rotations(h: int, d: int, granularity: str, g: torch.Generator) -> LayerQuantParams:
    n = h if granularity == "kv_head" else 1
    rk = torch.linalg.qr(torch.randn(n, d, d, generator=g))[0]
    rv = torch.linalg.qr(torch.randn(n, d, d, generator=g))[0]
    mean = 0.3 * torch.randn(n, d, generator=g)
    kc = 0.85 + 0.1 * torch.rand(n, generator=g)
    vc = 0.85 + 0.1 * torch.rand(n, generator=g)
    if granularity == "layer":
        return LayerQuantParams(rk[0], rv[0], mean[0], float(kc[0]), float(vc[0]))
    return LayerQuantParams(rk, rv, mean, kc, vc)


def _schedule(case: Case) -> list[list[tuple[int, int]]]:
    """Steps as lists of (request, new tokens): chunked prefill, then decodes, mixed where they overlap."""
    done = [0] * len(case.prompts)
    left = [case.decode_steps] * len(case.prompts)
    steps = []
    while any(n > 0 for n in left):
        budget, step = case.chunk, []
        for r, p in enumerate(case.prompts):  # decodes first, like vLLM's scheduler
            if done[r] >= p and left[r] > 0 and budget > 0:
                step.append((r, 1))
                budget -= 1
        for r, p in enumerate(case.prompts):
            if done[r] < p and budget > 0:
                n = min(p - done[r], budget)
                step.append((r, n))
                budget -= n
        for r, n in step:
            if done[r] >= case.prompts[r]:
                left[r] -= 1
            done[r] += n
        steps.append(step)
    return steps


def _snapshot(cache):
    """A CPU copy of every tensor of a cache (views of one page buffer stay consistent)."""
    return replace(cache, **{f: getattr(cache, f).detach().cpu().clone() for f in cache.TENSOR_FIELDS})


def run_case(case: Case, device: torch.device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    tp, rank = case.tp
    heads = shard_kv_heads(case.h_kv * tp, tp, rank)
    full = _rotations(case.h_kv * tp, case.d, case.granularity, g)
    params = shard_params(full, heads)
    lo = CacheLayout(case.h_kv, case.d, case.page, case.group, case.sink, case.recent)
    total = [p + case.decode_steps for p in case.prompts]
    num_blocks = sum(-(-t // case.page) for t in total) + 7
    buf = torch.randint(0, 256, (num_blocks, page_bytes(lo)), dtype=torch.uint8, generator=g)  # garbage
    max_seqs = len(case.prompts) + 2
    dev_cache = cache_from_page_buffer(lo, buf.to(device), max_seqs)
    ref_cache = cache_from_page_buffer(lo, buf.clone(), max_seqs)
    ep_dev = params.expand(lo.num_kv_heads, lo.head_dim, device)
    ep_ref = params.expand(lo.num_kv_heads, lo.head_dim, torch.device("cpu"))
    free = list(range(1, num_blocks))  # block 0 stays the null block, as in vLLM
    rnd.shuffle(free)
    max_blocks = max(-(-t // case.page) for t in total)
    tables = [[] for _ in case.prompts]
    done = [0] * len(case.prompts)
    rows = list(range(max_seqs))
    rnd.shuffle(rows)
    slots_v1 = WindowSlots(max_seqs)
    scale = case.d**-0.5
    worst = {"code_mismatch": 0.0, "window_err": 0.0, "attn_rel_err": 0.0}
    hq = case.h_kv * case.gqa
    n_steps = 0
    for step in _schedule(case):
        b = len(step)
        qlens = [n for _, n in step]
        for r, n in step:
            while len(tables[r]) * case.page < done[r] + n:
                tables[r].append(free.pop())
        t = sum(qlens)
        pad = 3  # vLLM pads the token count; padding slots are -1
        slot = torch.full((t + pad,), -1, dtype=torch.int64)
        i = 0
        for r, n in step:
            for p in range(done[r], done[r] + n):
                slot[i] = tables[r][p // case.page] * case.page + p % case.page
                i += 1
        qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
        seq = torch.tensor([done[r] + n for r, n in step], dtype=torch.int32)
        table = torch.zeros(b, max_blocks, dtype=torch.int32)
        for j, (r, _) in enumerate(step):
            table[j, : len(tables[r])] = torch.tensor(tables[r], dtype=torch.int32)
        req_rows = torch.tensor([rows[r] for r, _ in step], dtype=torch.int32) if case.v2_rows else None
        q = torch.randn(t, hq, case.d, generator=g).to(torch.bfloat16)
        k = (torch.randn(t, case.h_kv, case.d, generator=g) * 2 + 0.5).to(torch.bfloat16)
        v = torch.randn(t, case.h_kv, case.d, generator=g).to(torch.bfloat16)
        slots_ref = copy.deepcopy(slots_v1)
        md_dev = build_step(
            qsl.to(device), qsl, seq.to(device), seq, table.to(device), slot.to(device), b,
            None if req_rows is None else req_rows.to(device), slots_v1,
        )  # fmt: skip
        md_ref = build_step(qsl, qsl, seq, seq, table, slot, b, req_rows, slots_ref)
        assert torch.equal(md_dev.window_slots.cpu(), md_ref.window_slots)
        # run_layer's order: a decode-only step writes everything before attention, an extend
        # step the INT2 rows + sink before and the ring rows after
        parts = "all" if md_ref.all_decode else "pages"
        write_step(dev_cache, ep_dev, k.to(device), v.to(device), md_dev, backend="triton", parts=parts)
        write_step(ref_cache, ep_ref, k, v, md_ref, backend="torch", parts=parts)
        snap = _snapshot(dev_cache)
        used = torch.tensor(sorted({blk for r, _ in step for blk in tables[r]}), dtype=torch.long)
        mism = max(
            float((snap.k_codes[used] != ref_cache.k_codes[used]).float().mean()),
            float((snap.v_codes[used] != ref_cache.v_codes[used]).float().mean()),
        )
        ws = md_ref.window_slots.long()
        werr = 0.0
        for f in ("k_sink", "v_sink", "k_recent", "v_recent"):
            a, r_ = getattr(snap, f)[ws].float(), getattr(ref_cache, f)[ws].float()
            werr = max(werr, float((a - r_).norm() / r_.norm().clamp_min(1e-6)))
        out = attend_step(
            dev_cache, ep_dev, q.to(device), k.to(device), v.to(device), md_dev, scale, backend="triton"
        )
        ref = attend_step(snap, ep_ref, q, k, v, md_ref, scale, backend="torch")
        if parts == "pages":
            write_step(dev_cache, ep_dev, k.to(device), v.to(device), md_dev, backend="triton", parts="ring")
            write_step(ref_cache, ep_ref, k, v, md_ref, backend="torch", parts="ring")
        out = out.float().cpu()
        err = float((out - ref.float()).norm() / ref.float().norm().clamp_min(1e-6))
        if not torch.isfinite(out).all():
            err = float("inf")
        worst = {
            "code_mismatch": max(worst["code_mismatch"], mism),
            "window_err": max(worst["window_err"], werr),
            "attn_rel_err": max(worst["attn_rel_err"], err),
        }
        for r, n in step:
            done[r] += n
        n_steps += 1
    ok = worst["code_mismatch"] < 0.02 and worst["window_err"] < 2e-2 and worst["attn_rel_err"] < 1e-2
    return {"case": case.name, "steps": n_steps, **worst, "pass": ok}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reduced", action="store_true", help="small cases (CPU with TRITON_INTERPRET=1)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", help="write the results as JSON")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    results = []
    for case in REDUCED if args.reduced else CASES:
        t0 = time.perf_counter()
        res = run_case(case, device)
        res["seconds"] = round(time.perf_counter() - t0, 2)
        results.append(res)
        print(json.dumps(res), flush=True)
    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"info": info, "results": results}, f, indent=1)
    ok = all(r["pass"] for r in results)
    print(("PASS" if ok else "FAIL") + f" ({len(results)} cases, {info})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
