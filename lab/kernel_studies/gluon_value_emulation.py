"""CPU emulation of the Gluon decode kernel's value path (numpy), to size its rounding error.

The kernel computes ``Σ_t p_t·(s_t·c_t + z_t)`` per quarter ``j`` of the head dimension from
fp16 operands ``x = 512 + f_j·c`` (``f_j = 4^j/2``) and ``pv = fp16(p·s)`` on the tensor
cores (``mma.sync`` with fp32 accumulation), and removes ``512·Σ pv`` algebraically.
NVIDIA's tensor cores add the products and the accumulator aligned to the largest exponent,
keep a few extra bits and *truncate* (Fasi et al., "Numerical behavior of NVIDIA tensor
cores", PeerJ CS 2021) — modelled here by :func:`tc_block` (blocks of 8 products, 3 extra
bits, round toward zero). Variants:

* ``split_offset``: the offset accumulated over the whole split and removed at the end
  (the kernel until 2026-12-01): the accumulator is ~``512·Σ pv``, ~700× the quarter-0
  signal, and its truncation bias grows with the tiles per split.
* ``tile_offset``: each tile's ``512·Σ_tile pv`` subtracted from the accumulator's initial
  value of that tile's ``mma`` (the kernel now): the accumulator holds only the signal.
* ``exact``: operands without the offset (``f_j·c``), for reference.

Data: written-like keys/values (heavy-ish channel scales and offsets, a random rotation,
INT2 per-row quantisation with clipping), scores exact; one sequence and KV head, GQA 4,
splits of the INT2 range as the kernel makes them, 64-token tiles.

Usage: ``python gluon_value_emulation.py [n_tokens]`` (about 15 s per 32k tokens per row).
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from oscar_math import quantize_int2, unpack_int2


def tc_block(c: np.ndarray, terms: np.ndarray, extra: int = 3) -> np.ndarray:
    """``c + Σ terms`` as the tensor cores do it: ``c [E, H]`` fp32 values, ``terms [k, E, H]``
    exact products; aligned to the largest exponent with ``extra`` bits, truncated to fp32."""
    mx = np.maximum(np.abs(c), np.abs(terms).max(0))
    e = np.floor(np.log2(np.where(mx > 0, mx, 1.0)))
    ulp = 2.0 ** (e - 23 - extra)
    s = np.trunc(c / ulp) * ulp + (np.trunc(terms / ulp) * ulp).sum(0)
    er = np.floor(np.log2(np.where(s != 0, np.abs(s), 1.0)))
    u2 = 2.0 ** (er - 23)
    return np.trunc(s / u2) * u2


def _f32(x):
    return np.asarray(x, dtype=np.float32).astype(np.float64)


def written_like(n: int, d: int, gen: torch.Generator):
    """Codes, scales and zeros of ``n`` rotated value rows and dequantised keys, like gpu_run's writes."""

    def rows():
        x = torch.randn(n, d, generator=gen) * (1 + 2 * torch.rand(d, generator=gen))
        return x + torch.randn(d, generator=gen)

    rot, _ = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
    qv = quantize_int2(rows().bfloat16().float() @ rot.float(), d, 0.9)
    qk = quantize_int2(rows().bfloat16().float() @ rot.float(), d, 0.9)
    vc = unpack_int2(qv.codes).double().numpy()
    vs, vz = (t.float().double().numpy()[:, 0] for t in (qv.scale, qv.zero))
    kd = (unpack_int2(qk.codes).double() * qk.scale.float().double() + qk.zero.float().double()).numpy()
    return vc, vs, vz, kd


def run(n=131072, ns=132, bn=64, g=4, d=128, seed=0, variant="split_offset", sink=64, recent=256):
    """Relative error of the emulated output (rotated basis) vs float64, per quarter, and the
    ratio |code part| / |output| (how much a relative error of the code part is amplified)."""
    gen = torch.Generator().manual_seed(seed)
    vc, vs, vz, kd = written_like(n, d, gen)
    q = torch.randn(g, d, generator=gen).bfloat16().double().numpy()
    vd = vc * vs[:, None] + vz[:, None]
    lo, hi = sink, n - recent  # the INT2 range (windows are exact bf16 rows: not emulated)
    s = (kd[lo:hi] @ q.T) / math.sqrt(d)
    p_all = np.exp(s - s.max(0))
    want = (p_all.T @ vd[lo:hi]) / p_all.sum(0)[:, None]
    per = math.ceil(math.ceil((hi - lo) / ns) / bn) * bn
    f = np.array([0.5, 2.0, 8.0, 32.0])
    q4 = d // 4
    off = 0.0 if variant == "exact" else 512.0
    outs, lses = [], []
    for sp in range(ns):
        a0, a1 = lo + sp * per, min(hi, lo + (sp + 1) * per)
        if a0 >= a1:
            continue
        m = np.full(g, -np.inf)
        l_i = np.zeros(g)
        acc = np.zeros((4, q4, g))
        lps = np.zeros(g)
        lpz = np.zeros(g)
        for t0 in range(a0, a1, bn):
            t1 = min(a1, t0 + bn)
            st = _f32(s[t0 - lo : t1 - lo])
            m_new = np.maximum(m, st.max(0))
            alpha = _f32(np.exp(m - m_new))
            p = _f32(np.exp(st - m_new))
            m = m_new
            l_i = _f32(l_i * alpha + p.sum(0))
            pv = (p * vs[t0:t1, None]).astype(np.float16).astype(np.float64)
            lps = _f32(lps * alpha + pv.sum(0))
            lpz = _f32(lpz * alpha + (p * vz[t0:t1, None]).sum(0))
            for j in range(4):
                x = vc[t0:t1, j * q4 : (j + 1) * q4] * f[j] + off
                c = _f32(acc[j] * alpha[None, :])
                if variant == "tile_offset":
                    c = _f32(c - 512.0 * pv.sum(0)[None, :])
                for b0 in range(0, t1 - t0, 8):
                    c = tc_block(c, x[b0 : b0 + 8, :, None] * pv[b0 : b0 + 8, None, :])
                acc[j] = c
        o = np.zeros((g, d))
        for j in range(4):
            aj = acc[j] - (512.0 * lps[None, :] if variant == "split_offset" else 0.0)
            o[:, j * q4 : (j + 1) * q4] = (aj / f[j] + lpz[None, :]).T
        outs.append(o / l_i[:, None])
        lses.append(m + np.log(l_i))
    lse = np.array(lses)
    w = np.exp(lse - lse.max(0))
    w /= w.sum(0)
    out = np.einsum("sg,sgd->gd", w, np.array(outs))
    nrm = np.linalg.norm(want)
    err = float(np.linalg.norm(out - want) / nrm)
    diff = out - want
    qerr = [float(np.linalg.norm(diff[:, j * q4 : (j + 1) * q4]) / nrm) for j in range(4)]
    code = (p_all.T @ (vc[lo:hi] * vs[lo:hi, None])) / p_all.sum(0)[:, None]
    return err, qerr, float(np.linalg.norm(code) / nrm)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    for ns in (132, 33):
        for var in ("split_offset", "tile_offset", "exact"):
            e, qe, amp = run(n=n, ns=ns, variant=var)
            qs = " ".join(f"{x:.1e}" for x in qe)
            print(f"n={n} splits={ns:3d} {var:12s} err={e:.2e} quarters={qs} |code|/|out|={amp:.1f}")
