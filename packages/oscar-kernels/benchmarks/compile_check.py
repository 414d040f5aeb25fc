"""Compile a decode split kernel for sm_90 without a GPU and report what ptxas says.

A dry run for the H200 script: catches lowering errors of a kernel variant, and shows
registers / spills / instruction counts, using the ``ptxas`` shipped in the Triton wheel.
The local Triton (3.9) may differ from the device's (3.6), so treat the numbers as
indicative.

Usage::

    PYTHONPATH=packages/oscar-math/src:packages/oscar-kernels/src \\
        python packages/oscar-kernels/benchmarks/compile_check.py [--impl gluon|tl] [--block-n 32 64] ...
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

PTX_KEYS = (
    "mma.sync",
    "wgmma",
    "prmt.b32",
    "ldmatrix",
    "st.shared",
    "ld.shared",
    "bar.sync",
    "shfl.sync",
    "cvt.",
    "ld.global.v2.b32",
    "ld.global.b32",
    "ld.global.b16",
    "ld.global.b8",
)


def _compile_tl(block_n: int, num_warps: int, gqa: int, d: int, windows: bool, group: int | None, arch: int):
    import triton
    import triton.language as tl

    from oscar_kernels.kernels.attention import decode_split_kernel as fn

    ptr = dict.fromkeys(("kc_ptr", "vc_ptr"), "*u8")
    ptr.update(dict.fromkeys(("bt_ptr", "seqlen_ptr", "wslot_ptr"), "*i32"))
    ptr.update(dict.fromkeys(("po_ptr", "plse_ptr"), "*fp32"))
    consts = dict(
        H_KV=8,
        GQA=gqa,
        G_PAD=max(16, triton.next_power_of_2(gqa)),
        HEAD_DIM=d,
        GROUP=group or d,
        SINK=64 if windows else 0,
        RECENT=256 if windows else 0,
        RING=256,
        NUM_SPLITS=16,
        BLOCK_N=block_n,
        BLOCK_W=64,
        DOT=tl.bfloat16,
        UNPACK=0,
        ROPE_R=0,  # no pre-RoPE mean term (format 2); the kernel's defaults must be spelled out here
        ROPE_P=0,
        stride_st=1,  # as the runtime specialises the benchmark shape
    )
    return _compile(fn, consts, ptr, arch, num_warps)


def _compile(fn, consts: dict, ptr: dict, arch: int, num_warps: int, num_stages: int = 0):  # noqa: ANN001, ANN202
    """``fn`` compiled for ``sm_<arch>``: constexprs ``consts``, pointer types ``ptr`` (other
    ``*_ptr`` arguments bf16), ``sm_scale_log2`` fp32, other arguments i32 divisible by 16;
    ``num_stages`` 0: Triton's default."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name == "sm_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = ptr.get(name, "*bf16" if name.endswith("_ptr") else "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def compile_extend(
    arch: int = 90,
    num_warps: int = 4,
    rope: bool = False,
    splits: int = 1,
    block_n: int = 64,
    block_m: int = 64,
    num_stages: int = 0,
    page_tiles: bool = True,
):  # noqa: ANN201, E501
    """The extend (prefill / mixed-step) kernel at the Qwen3-8B shape for ``sm_<arch>``; ``rope``:
    with the pre-RoPE key mean's score term (format 3); ``splits > 1``: the split-INT2 variant
    (partials for ``merge_splits_kernel``)."""
    import triton.language as tl

    from oscar_kernels.decode_attention import rope_slots
    from oscar_kernels.kernels.attention import extend_kernel as fn

    rp = rope_slots(8) if rope else 0
    consts = dict(
        H_Q=32, GQA=4, HEAD_DIM=128, GROUP=128, SINK=64, RECENT=256, RING=256, BLOCK_M=block_m,
        BLOCK_N=block_n, DOT=tl.bfloat16, UNPACK=0, ROPE_R=8 if rope else 0, ROPE_P=rp,
    )  # fmt: skip
    if "PAGE_TILES" in fn.arg_names:  # 64-token pages, as vLLM's OSCAR engines have
        consts["PAGE_TILES"] = page_tiles
    ptr = dict.fromkeys(("kc_ptr", "vc_ptr"), "*u8")
    ptr.update(dict.fromkeys(("bt_ptr", "cu_ptr", "prefix_ptr", "wslot_ptr"), "*i32"))
    ptr.update(dict.fromkeys(("o_ptr", "rc_ptr", "rth_ptr"), "*fp32"))
    if not rope:
        consts.update(rc_ptr=None, rth_ptr=None)
    consts["SPLIT"] = splits > 1  # the count itself is a run-time argument
    if splits > 1:
        ptr.update(dict.fromkeys(("po_ptr", "plse_ptr"), "*fp32"))
    else:
        consts.update(po_ptr=None, plse_ptr=None)
    return _compile(fn, consts, ptr, arch, num_warps, num_stages)


def compile_write_kv(  # noqa: ANN201
    arch: int = 90,
    num_warps: int = 8,
    block_t: int = 16,
    rope: bool = True,
    feedback: bool = False,
    probe: bool = False,
    head_dim: int = 128,
    fb_rows: int = 4,
    parts: str = "all",
    trigger: bool = False,
):
    """The decode write with K and V in one launch (``paged_write_kv_kernel``) at the Qwen3-8B shape
    (``feedback``: error feedback on the keys, the default artifact's case; ``probe``: its phase
    timer stamps, a diagnosis build), as a GPU launch builds it: ``PREFETCH`` on and, with
    feedback, ``F``'s row stride 1 (``expand`` stores it column-major; Triton specialises an
    integer argument equal to 1 as a constant); ``fb_rows``: the feedback loop's rows at a time (a
    decode write's ``FEEDBACK_CHUNK_ROWS``; 0: the whole tile); ``parts``: as ``paged_write``'s;
    ``trigger``: lets a programmatic dependent start at once (a window pass's ``TRIGGER``)."""
    import triton.language as tl  # noqa: F401  (the kernel module needs it importable)

    from oscar_kernels.kernels.paged_write import paged_write_kv_kernel as fn
    from oscar_kernels.paged_write import PART_ROWS

    codes, sink, ring = PART_ROWS[parts]

    consts = dict(
        NUM_KV_HEADS=8, HEAD_DIM=head_dim, GROUP=head_dim, SINK=64, RECENT=256, HAS_MEAN=True,
        K_FEEDBACK=feedback, V_FEEDBACK=False, HAS_ROPE=rope, WRITE_PAGES=codes, WRITE_RING=ring,
        WRITE_SINK=sink, BLOCK_T=block_t, DOT_PRECISION="tf32", PROBE=probe, PREFETCH=True, FB_ROWS=fb_rows,
        TRIGGER=trigger,
    )  # fmt: skip
    if feedback:
        consts["stride_kfr"] = 1
    ptr = dict.fromkeys(
        ("krot_ptr", "vrot_ptr", "mean_ptr", "rmean_ptr", "freq_ptr", "kfb_ptr", "vfb_ptr"), "*fp32"
    )
    if probe:
        ptr["probe_ptr"] = "*i64"
    else:
        consts["probe_ptr"] = None
    ptr.update(dict.fromkeys(("kalpha_ptr", "valpha_ptr"), "*fp32"))
    ptr.update(dict.fromkeys(("kcodes_ptr", "vcodes_ptr"), "*u8"))
    ptr.update(dict.fromkeys(("pos_ptr", "seqidx_ptr", "seqlen_ptr", "wslot_ptr"), "*i32"))
    ptr["slot_ptr"] = "*i64"
    ptr["scr_ptr"] = "*fp32"
    return _compile(fn, consts, ptr, arch, num_warps)


def ptx_loops(ptx: str) -> list[dict]:
    """Every loop of ``ptx`` (a backward branch to a label): its length in lines, how many
    ``bar.sync``, ``shfl.sync``, global loads and branches its body holds (what one iteration issues) and
    whether it holds another loop (``inner``)."""
    import re

    lines = ptx.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"^\$(L__BB\d+_\d+):", line.strip())
        if m:
            labels[m.group(1)] = i
    loops, spans = [], []
    for i, line in enumerate(lines):
        m = re.search(r"bra(?:\.uni)?\s+\$(L__BB\d+_\d+);", line)
        if m and labels.get(m.group(1), i) < i:
            body = lines[labels[m.group(1)] : i + 1]
            spans.append((labels[m.group(1)], i))
            loops.append(
                {
                    "lines": len(body),
                    "bar.sync": sum("bar.sync" in x for x in body),
                    "shfl.sync": sum("shfl.sync" in x for x in body),
                    "ld.global": sum("ld.global" in x for x in body),
                    "bra": sum(re.search(r"\bbra(\.uni)?\s", x) is not None for x in body),
                    "globaltimer": sum("%globaltimer" in x for x in body),
                }
            )
    for lp, (a, b) in zip(loops, spans, strict=True):
        # an outer loop's counts include its inner loops' lines
        lp["inner"] = any(a < c and d < b for c, d in spans)
    return loops


def compile_rotate_rows(arch: int = 90, rows: int = 16, wait_end: bool = False, rope: bool = True):  # noqa: ANN201
    """The decode op's query rotation (``rotate_rows_kernel``) at the Qwen3-8B shape for
    ``sm_<arch>``, as a PDL-capable GPU launches it; ``wait_end``: as a programmatic dependent of
    the window pass (it waits for that pass before it ends)."""
    from oscar_kernels.decode_attention import rope_slots
    from oscar_kernels.kernels.attention import rotate_rows_kernel as fn

    rp = rope_slots(8) if rope else 0
    consts = dict(HEAD_DIM=128, RC=32, PDL=True, ROWS=rows, ROPE_R=8 if rope else 0, ROPE_P=rp,
                  WAIT_END=wait_end)  # fmt: skip
    ptr = dict.fromkeys(("rot_ptr", "rc_ptr", "ab_ptr"), "*fp32")
    ptr["pairs_ptr"] = "*i32"
    if not rope:
        consts.update(rc_ptr=None, ab_ptr=None, pairs_ptr=None)
    return _compile(fn, consts, ptr, arch, 4)


def compile_bf16_baseline(arch: int = 90, num_warps: int = 4):  # noqa: ANN201
    """The BF16-pages baseline split kernel (``kernels/bf16_decode.py``) for ``sm_<arch>``."""
    import triton.language as tl

    from oscar_kernels.kernels.bf16_decode import bf16_decode_split_kernel as fn

    consts = dict(H_KV=8, GQA=4, G_PAD=16, HEAD_DIM=128, NUM_SPLITS=16, BLOCK_N=64, DOT=tl.bfloat16)
    ptr = {"bt_ptr": "*i32", "seqlen_ptr": "*i32", "po_ptr": "*fp32", "plse_ptr": "*fp32"}
    return _compile(fn, consts, ptr, arch, num_warps)


def compile_merge(impl: str = "v2", arch: int = 90, d: int = 128, pdl: bool = True, **kw) -> dict:
    """The decode merge's kernels for ``sm_<arch>`` (ptxas reports by kernel): ``v2``
    (``merge_cols_kernel`` + ``unrotate_rows_kernel``, :class:`DecodeTuning`'s ``merge_*``
    defaults unless ``kw`` names them: ``block_d``, ``chunk``, ``warps``, ``rows``, ``cols``) or
    ``v1`` (``merge_splits_kernel`` with its ``[d, d]`` rotation preloaded, 8 warps). Scalars are
    compiled unspecialised (the split count ``NT`` takes any value); pointers 16-byte aligned."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from oscar_kernels.kernels import attention as A

    def build(fn, consts: dict, ptr: dict, num_warps: int) -> dict:
        sig, attrs = {}, {}
        for i, name in enumerate(fn.arg_names):
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = ptr.get(name, "*fp32")
                attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                sig[name] = "i32"
        src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
        return ptxas_report(k.asm["ptx"], arch) | {"fma.rn.f32": k.asm["ptx"].count("fma.rn.f32")}

    out_ptr = {"out_ptr": "*bf16"}
    if impl == "v1":
        c = dict(HEAD_DIM=d, CH=64, ROTATE=True, RC=32, PDL=pdl, PRELOAD=True)
        return {"merge_splits_kernel": build(A.merge_splits_kernel, c, out_ptr, 8)}
    from oscar_kernels.decode_attention import DEFAULT_TUNING as T

    warps = kw.get("warps", T.merge_num_warps)
    c1 = dict(HEAD_DIM=d, DC=kw.get("block_d", T.merge_block_d), CH=kw.get("chunk", T.merge_chunk), PDL=pdl)
    c1["DEPENDENTS"] = pdl
    c2 = dict(HEAD_DIM=d, BM=kw.get("rows", T.merge_rotate_rows), OC=kw.get("cols", T.merge_rotate_cols))
    c2.update(KC=kw.get("kc", min(32, d)), PDL=pdl)
    return {
        "merge_cols_kernel": build(A.merge_cols_kernel, c1, {}, warps),
        "unrotate_rows_kernel": build(A.unrotate_rows_kernel, c2, out_ptr, warps),
    }


def compile_merge_unrotate(arch: int = 90, num_warps: int = 4, two: bool = True):  # noqa: ANN201
    """The dense prefill's two-set merge + un-rotation (``kernels/rotate.py``) at the Qwen3-8B
    shape for ``sm_<arch>``, as ``rotate.merge_unrotate`` launches it."""
    from oscar_kernels.kernels.rotate import merge_unrotate_kernel as fn

    consts = dict(H=8, D=128, BLOCK_M=64, BLOCK_N=64, TWO=two)
    ptr = {"l1_ptr": "*fp32", "l2_ptr": "*fp32", "rot_ptr": "*fp32"}
    return _compile(fn, consts, ptr, arch, num_warps)


def compile_near_rows(arch: int = 90, num_warps: int = 4, sink: int = 64):  # noqa: ANN201
    """The dense prefill's near-set rows (``kernels/near_rows.py``) for ``sm_<arch>``."""
    from oscar_kernels.kernels.near_rows import near_rows_kernel as fn

    consts = dict(D=128, D_P2=128, SINK=sink, BLOCK=64)
    ptr = {"seq_ptr": "*i64", "pos_ptr": "*i64", "pre_ptr": "*i32", "start_ptr": "*i64", "ws_ptr": "*i32"}
    return _compile(fn, consts, ptr, arch, num_warps)


def compile_window_records(arch: int = 90, num_warps: int = 4, rows_per_page: int = 144):  # noqa: ANN201
    """The window-record write (``kernels/window_records.py``) at vLLM's default geometry (block 64,
    ring 256, sink 64 in parts of 16; ``rows_per_page`` bf16 rows of ``d`` in a page) for ``sm_<arch>``."""
    from oscar_kernels.kernels.window_records import window_records_kernel as fn
    from oscar_kernels.window_records import _TC, _TOK

    consts = dict(
        H=8, SINK=64, PART=16, PART_P2=16, D=128, D_P2=128, SINK_IN_RING=True, TOK=_TOK, TC=_TC,
        RPP=rows_per_page, RING=256, WB=64, PARTS=4,
    )  # fmt: skip
    ptr = {
        "tab_ptr": "*i32", "slot_map_ptr": "*i64", "sidx_ptr": "*i32", "pos_ptr": "*i32",
        "wslot_ptr": "*i32", "rring_ptr": "*i32",
    }  # fmt: skip
    return _compile(fn, consts, ptr, arch, num_warps)


def compile_decode(
    impl: str,
    block_n: int,
    num_warps: int,
    gqa: int,
    d: int = 128,
    arch: int = 90,
    windows: bool = True,
    group: int | None = None,
    prefetch: bool = True,
) -> dict:
    """Compile the ``tl`` or ``gluon`` decode split kernel for ``sm_<arch>``; PTX counts and ptxas -v.

    ``windows=False`` compiles the INT2 tile loop alone (no sink / ring branches), so the
    static instruction counts are those of one INT2 tile (plus prologue / epilogue).
    """

    if impl == "gluon":
        from oscar_kernels.kernels.attention_gluon import compile_decode_gluon

        k = compile_decode_gluon(arch, gqa, d, block_n, num_warps, windows, prefetch)
    else:
        k = _compile_tl(block_n, num_warps, gqa, d, windows, group, arch)
    return ptxas_report(k.asm["ptx"], arch)


def ptxas_report(ptx: str, arch: int = 90) -> dict:
    """PTX instruction counts, and registers / spill bytes from the bundled ``ptxas -v``."""
    import triton

    out = {key: ptx.count(key) for key in PTX_KEYS}
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
    ap.add_argument("--impl", default="gluon", choices=("gluon", "tl"))
    ap.add_argument("--block-n", type=int, nargs="*", default=[32, 64])
    ap.add_argument("--warps", type=int, nargs="*", default=None, help="default: 1 (gluon), 4 (tl)")
    ap.add_argument("--gqa", type=int, nargs="*", default=[4])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--no-windows", action="store_true", help="the INT2 tile loop alone")
    ap.add_argument("--no-prefetch", action="store_true", help="gluon: no register double buffering")
    ap.add_argument("--group", type=int, default=None, help="quantisation group (default d; tl only)")
    ap.add_argument("--merge", choices=("v1", "v2"), default=None, help="compile the decode merge instead")
    ap.add_argument("--merge-kc", type=int, default=None, help="v2 un-rotation: d terms per FMA dot step")
    a = ap.parse_args()
    if a.merge:
        for w in a.warps or [None]:
            kw = {} if w is None else {"warps": w}
            if a.merge_kc:
                kw["kc"] = a.merge_kc
            for name, r in compile_merge(a.merge, d=a.d, **kw).items():
                print(f"merge={a.merge} d={a.d} {kw} {name}: {r}", flush=True)
        return
    warps = a.warps or [1 if a.impl == "gluon" else 4]
    for g in a.gqa:
        for bn in a.block_n:
            for w in warps:
                r = compile_decode(
                    a.impl, bn, w, g, a.d, windows=not a.no_windows, group=a.group, prefetch=not a.no_prefetch
                )
                print(f"impl={a.impl} gqa={g} d={a.d} block_n={bn} warps={w}: {r}", flush=True)


if __name__ == "__main__":
    main()
