"""Compile the decode split kernel for sm_90 without a GPU and report what ptxas says.

A dry run for the H200 script: catches Triton lowering errors of a kernel variant, and
shows registers / spills / instruction counts, using the ``ptxas`` shipped in the
Triton wheel. The local Triton may differ from the device's (3.6), so treat the
numbers as indicative.

Usage::

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python packages/oscar-kernels/benchmarks/compile_check.py [--impl fma] [--block-n 64] ...
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile


def compile_decode(
    impl: str,
    block_n: int,
    num_warps: int,
    gqa: int,
    d: int = 128,
    funpack: int = 1,
    arch: int = 90,
    windows: bool = True,
    group: int | None = None,
) -> dict:
    """Compile ``decode_split_kernel`` for ``sm_<arch>``; returns PTX counts and ptxas -v figures.

    ``windows=False`` compiles the INT2 tile loop alone (no sink / ring branches), so the
    static instruction counts are those of one INT2 tile.
    """
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from oscar_kernels.kernels.attention import decode_split_kernel

    fma = impl.startswith("fma")
    fn = decode_split_kernel
    ptr = {
        "q_ptr": "*bf16",
        "kc_ptr": "*u8",
        "vc_ptr": "*u8",
        "ks_ptr": "*bf16",
        "kz_ptr": "*bf16",
        "vs_ptr": "*bf16",
        "vz_ptr": "*bf16",
        "ksink_ptr": "*bf16",
        "vsink_ptr": "*bf16",
        "kring_ptr": "*bf16",
        "vring_ptr": "*bf16",
        "bt_ptr": "*i32",
        "seqlen_ptr": "*i32",
        "wslot_ptr": "*i32",
        "po_ptr": "*fp32",
        "plse_ptr": "*fp32",
    }
    consts = dict(
        H_KV=8,
        GQA=gqa,
        G_PAD=triton.next_power_of_2(gqa) if fma else max(16, triton.next_power_of_2(gqa)),
        HEAD_DIM=d,
        GROUP=group or d,
        SINK=64 if windows else 0,
        RECENT=256 if windows else 0,
        RING=256,
        NUM_SPLITS=16,
        BLOCK_N=block_n,
        BLOCK_W=64,
        PAGED_BF16=False,
        DOT=tl.float32 if fma else tl.bfloat16,
        UNPACK=0,
        FMA={"dot": 0, "fma": 1, "fma-kt": 2, "fma-t": 3}[impl],
        FUNPACK=funpack,
    )
    # as the runtime specialises the benchmark shape: every pointer and integer is a
    # multiple of 16 except the scale/zero token stride, which is 1 (a constant)
    consts["stride_st"] = 1
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = ptr.get(name, "fp32" if name == "sm_scale_log2" else "i32")
        if name != "sm_scale_log2":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    k = triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": 2})
    ptx = k.asm["ptx"]
    out = {
        k_: ptx.count(k_)
        for k_ in (
            "mma.sync",
            "wgmma",
            "ldmatrix",
            "st.shared",
            "ld.shared",
            "bar.sync",
            "fma.rn.f32",
            "cvt.",
            "shfl.sync",
        )
    }
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    # Triton 3.9 emits PTX 9.x, which only the newer bundled ptxas accepts
    ptxas = next(
        (
            os.path.join(bindir, n)
            for n in ("ptxas-blackwell", "ptxas")
            if os.path.exists(os.path.join(bindir, n))
        ),
        "ptxas",
    )
    with tempfile.TemporaryDirectory() as tmp:
        p = os.path.join(tmp, "k.ptx")
        with open(p, "w") as f:
            f.write(ptx)
        r = subprocess.run(
            [ptxas, "-v", f"-arch=sm_{arch}a", p, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    info = r.stderr
    m = re.search(r"Used (\d+) registers", info)
    out["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes spill stores", info)
    out["spill_store_bytes"] = int(m.group(1)) if m else None
    out["ptxas_ok"] = r.returncode == 0
    if r.returncode != 0:
        out["ptxas_error"] = info.strip()[-300:]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="fma")
    ap.add_argument("--block-n", type=int, nargs="*", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="*", default=[4])
    ap.add_argument("--gqa", type=int, nargs="*", default=[4])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--funpack", type=int, default=1)
    ap.add_argument("--no-windows", action="store_true", help="the INT2 tile loop alone")
    ap.add_argument("--group", type=int, default=None, help="quantisation group (default d)")
    a = ap.parse_args()
    for g in a.gqa:
        for bn in a.block_n:
            for w in a.warps:
                r = compile_decode(a.impl, bn, w, g, a.d, a.funpack, windows=not a.no_windows, group=a.group)
                print(
                    f"impl={a.impl} gqa={g} d={a.d} group={a.group} block_n={bn} warps={w}: {r}", flush=True
                )


if __name__ == "__main__":
    main()
