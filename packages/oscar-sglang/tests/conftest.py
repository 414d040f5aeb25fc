"""Without a GPU, oscar-kernels' Triton kernels run under Triton's interpreter where a test asks for
them (``backend="triton"``); the variable is read when a kernel module is first imported, so it is
set here, before any test imports one. The engine's default path on a CPU is the torch reference."""

from __future__ import annotations

import os

try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # the module-level skips of the test files say why
    pass
