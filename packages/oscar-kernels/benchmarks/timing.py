"""The one timing helper the benchmarks share (CUDA events via triton.testing.do_bench)."""

from __future__ import annotations

import time

import torch


def bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    """Median milliseconds of ``fn()`` (events, L2 flushed between runs by do_bench)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def bench_graph_ms(fn, rep_ms: int = 100) -> float:
    """Median ms of replaying a CUDA graph of ``fn`` (launch gaps removed; proves capturability)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return bench_ms(g.replay, rep_ms=rep_ms)


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read + written (GB/s)."""
    x = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), rep_ms=200)
    return 2 * x.numel() / ms / 1e6


def run_meta() -> dict:
    """What a results file records about the run: device, torch, Triton, UTC time."""
    import triton

    return dict(
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        triton=triton.__version__,
        time=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    )
