"""Shared fixtures: the Triton interpreter on CPU, a cache filled with random tokens."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys

# Under the interpreter tl.dot is numpy's matmul (OpenBLAS), and some tests hold kernels to bitwise
# batch invariance (a token's rotation whatever its row in a tile). OpenBLAS's AVX2 kernels (its
# Haswell core, which these machines preset in OPENBLAS_CORETYPE, and Zen's) round a row by its
# place in the block on an AMD EPYC; its AVX kernel does not, and runs on every x86-64 CPU. Read
# when numpy first loads OpenBLAS: before torch imports numpy.
if platform.machine() == "x86_64" and "numpy" not in sys.modules:
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # kernels import Triton lazily, so this takes effect before any @triton.jit runs
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install oscar-kernels[triton])"
)


def rand_orth(*shape: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(*shape, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()


def signed_hadamard(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """Hadamard matrices with random row signs and column order: entries ``±1/sqrt(d)``,
    exact in fp32 and tf32 when ``d`` is a power of 4 (16, 64, 256)."""
    from oscar_math.hadamard import hadamard_matrix

    d = shape[-1]
    h = hadamard_matrix(d, torch.float32)
    n = 1 if len(shape) == 2 else shape[0]
    out = []
    for _ in range(n):
        sign = torch.randint(0, 2, (d, 1), generator=gen).float() * 2 - 1
        out.append((sign * h)[:, torch.randperm(d, generator=gen)])
    return out[0] if len(shape) == 2 else torch.stack(out)


def dyadic(*shape: int, gen: torch.Generator, scale: int = 8, span: int = 32) -> torch.Tensor:
    """Multiples of ``1/scale`` in ``[-span/scale, span/scale)``: exact in bf16, and their
    sums of products with :func:`signed_hadamard` entries are exact in fp32 in any order."""
    return torch.randint(-span, span, shape, generator=gen).float() / scale


def random_feedback(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """Error-feedback matrices ``[..., d, d]`` (strictly lower triangular) of random anisotropic
    metrics, as calibration makes them (``oscar_math.feedback_matrix``)."""
    from oscar_math.feedback import feedback_matrix

    d = shape[-1]
    n = 1 if len(shape) == 2 else shape[0]
    q = torch.linalg.qr(torch.randn(n, d, d, generator=gen, dtype=torch.float64))[0]
    lam = torch.logspace(0, -3, d, dtype=torch.float64)
    f = feedback_matrix(q @ torch.diag(lam) @ q.transpose(-1, -2))
    return f[0] if len(shape) == 2 else f


def make_params(
    hkv: int, d: int, granularity: str, gen: torch.Generator, exact: bool = False, feedback: str = ""
):
    """Random rotations, key mean and clip ratios; ``exact``: rotations and mean for which
    rotating dyadic keys is exact arithmetic (so any summation order gives the same bits).
    ``feedback``: ``"k"``, ``"v"`` or ``"kv"`` adds random error-feedback matrices."""
    from oscar_kernels import LayerQuantParams

    shape = (d, d) if granularity == "layer" else (hkv, d, d)
    rot = signed_hadamard if exact else rand_orth
    rk, rv = rot(*shape, gen=gen), rot(*shape, gen=gen)
    mean = dyadic(hkv, d, gen=gen, scale=16, span=8) if exact else 0.5 * torch.randn(hkv, d, generator=gen)
    return LayerQuantParams(
        rk,
        rv,
        k_mean=mean,
        k_clip=0.8 + 0.2 * torch.rand(hkv, generator=gen),
        v_clip=0.9,
        k_feedback=random_feedback(*shape, gen=gen) if "k" in feedback else None,
        v_feedback=random_feedback(*shape, gen=gen) if "v" in feedback else None,
    )


def fill_cache(
    layout,
    lens,
    gen,
    granularity="layer",
    backend="torch",
    steps=0,
    cuts=None,
    pad=0,
    precise=False,
    exact=False,
    pending=None,
    feedback="",
    step_parts=("all",),
):
    """Allocate a cache and write random tokens for sequences of ``lens`` (scattered pages).

    The last ``steps`` tokens of each sequence are written one decode step at a time, each step
    as the writes of ``step_parts`` (``("window", "codes")``: a decode step's BF16 rows, then its
    INT2 rows, as the serving core writes them).
    ``cuts`` (instead of ``steps``): positions where a write ends and the next begins, the
    same for every sequence (``[]`` = one prefill-only write). ``pad`` padding tokens
    (slot -1, huge values, position 0 of sequence 0) are mixed into every write: they
    must change nothing. ``exact``: :func:`make_params` ``exact`` rotations and dyadic
    keys/values, so the rotation is exact arithmetic on every device. ``feedback``: see
    :func:`make_params`.
    Returns ``(cache, params, block_table, window_slots, keys, values)``.
    """
    from oscar_kernels import allocate_cache, paged_write

    ps = layout.page_size
    pages = [max(1, -(-n // ps)) for n in lens]
    num_pages = sum(pages) + 2
    perm = torch.randperm(num_pages, generator=gen)
    bt = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages):
        bt[b, :n] = perm[i : i + n].int()
        i += n
    ws = torch.randperm(len(lens) + 1, generator=gen)[: len(lens)].int()
    cache = allocate_cache(layout, num_pages, len(lens) + 1, DEVICE)
    for t in (cache.k_codes, cache.v_codes):  # garbage, not zeros, where nothing was written
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))
    params = make_params(layout.num_kv_heads, layout.head_dim, granularity, gen, exact, feedback)
    h, d = layout.num_kv_heads, layout.head_dim
    if exact:
        keys = [(dyadic(n, h, d, gen=gen) + 0.5).bfloat16().to(DEVICE) for n in lens]
        values = [dyadic(n, h, d, gen=gen).bfloat16().to(DEVICE) for n in lens]
    else:
        keys = [(torch.randn(n, h, d, generator=gen) * 2 + 0.5).bfloat16().to(DEVICE) for n in lens]
        values = [torch.randn(n, h, d, generator=gen).bfloat16().to(DEVICE) for n in lens]

    def write(first, last, parts="all"):
        rows = [(b, p) for b in range(len(lens)) for p in range(first[b], last[b])]
        if not rows:
            return
        b_idx = torch.tensor([r[0] for r in rows])
        pos = torch.tensor([r[1] for r in rows])
        slots = bt[b_idx, pos // ps].long() * ps + pos % ps
        k = torch.stack([keys[b][p] for b, p in rows])
        v = torch.stack([values[b][p] for b, p in rows])
        if pad:
            # padding tokens go before row ``at`` (random), the real rows keep their order
            at = torch.randint(0, len(rows) + 1, (pad,), generator=gen)
            order = torch.argsort(torch.cat([torch.arange(len(rows)) * 2 + 1, at * 2]), stable=True)
            junk = torch.full((pad, h, d), 1e4, dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, junk])[order], torch.cat([v, -junk])[order]
            slots = torch.cat([slots, -torch.ones(pad, dtype=slots.dtype)])[order]
            pos = torch.cat([pos, torch.zeros(pad, dtype=pos.dtype)])[order]
            b_idx = torch.cat([b_idx, torch.zeros(pad, dtype=b_idx.dtype)])[order]
        paged_write(
            cache,
            params,
            k,
            v,
            slots.to(DEVICE),
            pos.int().to(DEVICE),
            b_idx.int().to(DEVICE),
            torch.tensor(last, dtype=torch.int32, device=DEVICE),
            ws.to(DEVICE),
            backend=backend,
            precise=precise,
            parts=parts,
        )

    full = list(lens)
    if pending is not None:
        lens = [n - c for n, c in zip(full, pending, strict=True)]

    def finish():
        if pending is not None:
            write(lens, full, parts="pages")
        return cache, params, bt.to(DEVICE), ws.to(DEVICE), keys, values

    if cuts is not None:
        ends = sorted(set(cuts))
        done = [0] * len(lens)
        for e in [*ends, max(lens)]:
            nxt = [min(n, max(c, e)) for n, c in zip(lens, done, strict=True)]
            write(done, nxt)
            done = nxt
        return finish()
    pre = [max(0, n - steps) for n in lens]
    write([0] * len(lens), pre)
    for s in range(steps):
        cur = [min(n, p + s) for n, p in zip(lens, pre, strict=True)]
        for part in step_parts:
            write(cur, [min(n, c + 1) for n, c in zip(lens, cur, strict=True)], parts=part)
    return finish()


def extend_batch(lens, chunks, keys, values, query_heads: int, gen):
    """The packed extend batch of :func:`fill_cache`'s ``pending=chunks`` sequences: each sequence's
    last ``chunks[b]`` tokens as this step's chunk. Returns ``(q, k, v, cu_seqlens_q, prefix_lens)``
    (random bf16 queries drawn from ``gen`` after everything ``fill_cache`` drew)."""
    d = keys[0].shape[-1]
    cu = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    prefix = [n - c for n, c in zip(lens, chunks, strict=True)]
    pre = torch.tensor(prefix, dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(chunks), query_heads, d, generator=gen).bfloat16().to(DEVICE)
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([values[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    return q, k, v, cu, pre


def assert_one_step_rarely(name: str, x: torch.Tensor, y: torch.Tensor, frac: float) -> None:
    """At most ``frac`` of the elements differ, each by one code / one bf16 step."""
    if name.endswith("codes"):
        from oscar_math import unpack_int2

        diff = unpack_int2(x).int() - unpack_int2(y).int()
        assert (diff != 0).float().mean() <= frac and diff.abs().max() <= 1, name
        return
    xf, yf = x.float(), y.float()
    off = xf != yf
    assert off.float().mean() <= frac, (name, int(off.sum()))
    # one bf16 step is 2^-7 relative; near zero the fp32 rotation's cancellation error is
    # absolute (~1e-6 of the inputs' size, which is O(1) here), hence the 1e-4 floor
    assert ((xf - yf).abs() <= 2**-7 * yf.abs() + 1e-4)[off].all(), name


_COMPILE_CHECK = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("compile_check", sys.argv[1])
cc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cc)
try:
    from triton.backends.compiler import GPUTarget  # noqa: F401
except ImportError as e:
    print(f"SKIP installed Triton cannot target CUDA offline: {e}")
    sys.exit(0)
sys.stdout.write(eval(sys.argv[2], {"cc": cc}).asm["ptx"])
"""


def compile_check_ptx(call: str) -> str:
    """PTX of ``benchmarks/compile_check.py``'s ``call`` (e.g. ``"cc.compile_bf16_baseline(90)"``),
    compiled for the GPU without one, in a fresh process without the interpreter (kernels run
    under ``TRITON_INTERPRET=1`` leave Triton's language module patched). Skips, with the reason,
    on a GPU (the tests there compile and run the kernels for real) and where the installed
    Triton cannot target CUDA offline."""
    import subprocess
    import sys
    from pathlib import Path

    if HAS_CUDA:
        pytest.skip("on a GPU the kernel tests compile and run this kernel for real")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "compile_check.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE_CHECK, str(script), call],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    if r.stdout.startswith("SKIP "):
        pytest.skip(r.stdout[5:].strip())
    return r.stdout


def triton_specialisation(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton's own JIT compiles ``kernel`` per for this call on a CUDA GPU, computed on any
    machine: the kernel's Python function re-wrapped as a ``JITFunction`` (also under the
    interpreter, whose ``InterpretedFunction`` specialises nothing) and bound by Triton's binder
    with the NVIDIA backend (per tensor dtype and 16-byte alignment, per int 1 / multiple of 16,
    constexprs, ``do_not_specialize*`` honoured). ``("unbound", name)`` where this Triton has no
    such binder."""
    name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))
    try:
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.runtime.jit import JITFunction, create_function_from_signature
    except ImportError:
        return ("unbound", name)
    opts = getattr(kernel, "kwargs", None) or {}
    dns, dnsa = (
        getattr(kernel, a, None) or opts.get(a)
        for a in ("do_not_specialize", "do_not_specialize_on_alignment")
    )
    jit = JITFunction(kernel.fn, do_not_specialize=dns, do_not_specialize_on_alignment=dnsa)
    _, spec, options = create_function_from_signature(jit.signature, jit.params, CUDABackend)(*args, **kwargs)
    return (name, str(spec), str(sorted(options.items())))


def record_triton_specialisations(monkeypatch) -> None:
    """Make :func:`oscar_kernels.launch.record_launches` collect, next to OSCAR's own
    :func:`~oscar_kernels.launch.compile_key`, :func:`triton_specialisation` of each launch, and
    route the rotations to their Triton kernel under the interpreter too: the launches, and the
    keys, a GPU makes (the CPU default runs the rotations in torch, where nothing is launched)."""
    import oscar_kernels.launch as launch_mod
    import oscar_kernels.rotate as rotate_mod

    ours = launch_mod.compile_key

    def both(kernel, args, kwargs):
        return (*ours(kernel, args, kwargs), triton_specialisation(kernel, args, kwargs))

    monkeypatch.setattr(launch_mod, "compile_key", both)
    real = rotate_mod.use_triton
    monkeypatch.setattr(rotate_mod, "use_triton", lambda dev, b: real(dev, "triton" if b == "auto" else b))
