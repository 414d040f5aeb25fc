"""Choosing between the Triton kernels and the torch references (imports Triton lazily)."""

from __future__ import annotations

import functools
import importlib.util
import os
from enum import Enum

import torch

from oscar_math import OscarError, check

__all__ = ["Backend", "KernelUnavailableError", "triton_available", "use_triton", "interpreting"]


class Backend(str, Enum):
    """``auto``: Triton on CUDA tensors, torch reference elsewhere."""

    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"


class KernelUnavailableError(OscarError):
    """Triton kernels were asked for where they cannot run; the message names the fallback."""


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on CPU tensors, numpy semantics)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device: torch.device, backend: Backend | str) -> bool:
    """Whether to launch the Triton kernel for tensors on ``device``."""
    if backend == "auto":  # the engines' case, several times per layer: no enum work
        return device.type == "cuda" and triton_available()
    values = [b.value for b in Backend]
    check(backend in values, "backend", f"one of {values}", backend)
    b = Backend(backend)
    if b is Backend.TORCH:
        return False
    runnable = triton_available() and (device.type == "cuda" or interpreting())
    if b is Backend.TRITON and not runnable:
        raise KernelUnavailableError(
            f"Invalid backend: Triton kernels need triton and a CUDA device (or TRITON_INTERPRET=1), "
            f"got device {device}, triton installed={triton_available()}; use backend='torch' (the reference)"
        )
    return runnable and (b is Backend.TRITON or device.type == "cuda")


def dot_dtype():
    """Operand dtype of ``tl.dot``: bf16 on GPU; float32 under the interpreter, whose
    bf16 casts and dots are not exact (numpy has no bf16)."""
    import triton.language as tl

    return tl.float32 if interpreting() else tl.bfloat16


def unpack_mode() -> int:
    """Kernel constexpr for how INT2 codes become dot operands (``kernels/attention.py``'s
    ``_codes``): the PTX unpack on a GPU, float32 under the interpreter (no inline PTX there,
    and its bf16 casts are inexact)."""
    return 3 if interpreting() else 0
