"""Dense varlen attention kernels for prefill (``extend_attention_dense``) and the check each passes.

An engine hands :func:`oscar_kernels.extend_attention_dense` a FlashAttention kernel of its own
(vLLM: ``vllm_flash_attn``; SGLang: ``sgl_kernel``'s FA3). Where the engine has none, torch's
built-in FlashAttention-2 (``aten._flash_attention_forward``, in every CUDA build of torch) can
serve: :func:`torch_flash_attention`.

A third party's kernel is used only after :func:`check_dense_attention` found it equal to
:func:`oscar_kernels.dense_attention_ref` on a small probe at the model's head size (grouped
queries, a left window, a chunk longer than its keys, a sequence without keys). A kernel whose
conventions differ from the contract (the LSE's layout, the window's edge, a finite LSE for a row
without keys) is then refused at start-up with its reason, and prefill runs through OSCAR's Triton extend
kernel instead of giving wrong attention (:func:`pick_dense_attention`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from .extend_dense import DenseAttention, dense_attention_ref

__all__ = ["torch_flash_attention", "check_dense_attention", "pick_dense_attention", "PROBE"]

#: the probe's sequences: (query rows, key rows); a chunk longer than its keys leaves its first
#: rows without keys (causal, bottom-right aligned), and (3, 0) is a sequence without keys
PROBE: tuple[tuple[int, int], ...] = ((5, 12), (3, 0), (9, 4), (33, 70), (1, 17))
#: bf16 inputs: the kernel and the float32 reference differ by the bf16 rounding of the output
OUT_TOL, LSE_TOL = 3e-2, 1e-2


def torch_flash_attention() -> DenseAttention:
    """Torch's own FlashAttention-2 varlen forward as a :data:`DenseAttention` (CUDA, fp16/bf16).

    The op's LSE is ``[H_q, T]`` in current torch; an older padded ``[B, H_q, max_q]`` one is
    unpacked to that layout."""
    op = torch.ops.aten._flash_attention_forward.default

    def attn(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):  # noqa: ANN001, ANN202
        left, right = (int(window_left), 0) if int(window_left) >= 0 else (None, None)
        out, lse, *_ = op(
            q, k, v, cu_q, cu_k, max(int(max_q), 1), max(int(max_k), 1), 0.0, True, False, scale=float(scale),
            window_size_left=left, window_size_right=right,
        )  # fmt: skip
        return out, _lse_rows(lse, cu_q, q.shape[0])

    return attn


def _lse_rows(lse: torch.Tensor, cu_q: torch.Tensor, total: int) -> torch.Tensor:
    """``[H, T]`` float32 from a varlen kernel's LSE, ``[H, T]`` already or padded ``[B, H, max_q]``."""
    if lse.dim() == 2:
        return lse.float()
    row = torch.arange(total, device=lse.device)
    seq = torch.searchsorted(cu_q[1:].long(), row, right=True)
    return lse[seq, :, row - cu_q[seq].long()].t().float()


def check_dense_attention(
    attn: DenseAttention,
    device: torch.device | str,
    head_dim: int,
    kv_heads: int = 2,
    group: int = 2,
    dtype: torch.dtype = torch.bfloat16,
) -> str | None:
    """Why ``attn`` breaks the :data:`DenseAttention` contract on :data:`PROBE`, or ``None``.

    Random ``q [T, kv_heads·group, head_dim]`` and keys/values ``[N, kv_heads, head_dim]`` in
    ``dtype`` on ``device``, without and with a left window of 3, against
    :func:`~oscar_kernels.dense_attention_ref`: outputs within ``OUT_TOL``, LSEs within
    ``LSE_TOL`` where finite, infinite (either sign) where the reference's is."""
    # every tensor with an explicit device and dtype: engines build their layers (and call this)
    # under a default-device / default-dtype context (vLLM: `with torch.device("cuda")`)
    cpu = torch.device("cpu")
    gen = torch.Generator(cpu).manual_seed(0)
    nq, nk = [p[0] for p in PROBE], [p[1] for p in PROBE]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32, device=cpu).to(device, dtype)

    q, k, v = (
        rand(sum(nq), kv_heads * group, head_dim),
        rand(sum(nk), kv_heads, head_dim),
        rand(sum(nk), kv_heads, head_dim),
    )
    cu_q = torch.tensor([0, *itertools.accumulate(nq)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(nk)], dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    for window in (-1, 3):
        try:
            out, lse = attn(q, k, v, cu_q, cu_k, max(nq), max(nk), scale, window)
        except Exception as e:  # an unsupported head size or dtype, a changed signature
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
        ref_out, ref_lse = dense_attention_ref(q, k, v, cu_q, cu_k, max(nq), max(nk), scale, window)
        where = f"window_left={window}"
        if tuple(out.shape) != tuple(ref_out.shape) or tuple(lse.shape) != tuple(ref_lse.shape):
            return f"{where}: shapes out {tuple(out.shape)}, lse {tuple(lse.shape)}; expected " \
                f"{tuple(ref_out.shape)}, {tuple(ref_lse.shape)}"  # fmt: skip
        err = (out.float() - ref_out.float()).abs().max().item()
        if not err <= OUT_TOL:
            return f"{where}: output differs from the reference by {err:.3g} (tolerance {OUT_TOL})"
        lse = lse.float()
        finite = torch.isfinite(ref_lse)
        # a row without keys: FlashAttention says +inf, other kernels -inf; the merge takes either
        if not torch.equal(torch.isfinite(lse), finite):
            return f"{where}: rows without keys must give an infinite LSE (got {lse[~finite][:4].tolist()})"
        lerr = (lse[finite] - ref_lse[finite]).abs().max().item() if bool(finite.any()) else 0.0
        if not lerr <= LSE_TOL:
            return f"{where}: LSE differs from the reference by {lerr:.3g} (tolerance {LSE_TOL})"
    return None


def pick_dense_attention(
    candidates: Sequence[tuple[str, Callable[[], DenseAttention | None]]],
    device: torch.device | str,
    head_dim: int,
    kv_heads: int = 2,
    group: int = 2,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[str | None, DenseAttention | None, list[str]]:
    """The first of ``(name, factory)`` whose kernel passes :func:`check_dense_attention`.

    Returns ``(name, kernel, refusals)``; ``(None, None, refusals)`` when none passes (prefill then
    runs through the Triton extend kernel). ``refusals``: one ``"name: reason"`` line per candidate
    that did not load or failed the probe, for the engine's start-up log."""
    refusals: list[str] = []
    for name, factory in candidates:
        try:
            attn = factory()
        except Exception as e:  # not installed here (an ImportError), or no GPU build
            refusals.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        if attn is None:
            refusals.append(f"{name}: not available")
            continue
        try:
            why = check_dense_attention(attn, device, head_dim, kv_heads, group, dtype)
        except Exception as e:  # never a failed start-up: the Triton path serves instead
            why = f"the check itself failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if why is None:
            return name, attn, refusals
        refusals.append(f"{name}: {why}")
    return None, None, refusals
