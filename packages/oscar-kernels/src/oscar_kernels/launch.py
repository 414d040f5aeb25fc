"""Triton launches without Triton's per-call binding: a seen specialisation's compiled kernel, re-used.

``kernel[grid](*args, **kw)`` binds and specialises every argument, hashes a cache key, checks the
kernel's globals and builds launch metadata on each call: ~40 µs of host time per launch on the
H200 machine's CPU (Triton 3.6; ``lab/kernel_studies/host_cost.py --gpu``), and an eager decode
layer makes six launches. :func:`launch` makes the same launch; when it has seen a call with the
same specialisation it calls that compiled kernel's launcher directly (~8 µs of key in Python).

The key is finer than Triton's own (so a re-used kernel is always the one Triton would pick):
per tensor its dtype and whether its address is 16-byte aligned, per int whether it is 1, a
multiple of 16 and within int32, per constexpr its value, plus the launch options and device.
The first call of a key, Triton's interpreter, active launch hooks (profilers) and any argument
type not listed go through ``kernel[grid]`` unchanged.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

__all__ = ["launch", "clear_launch_cache", "fast_launch_available"]

_INT32 = (-(1 << 31), (1 << 31) - 1)


class _Slow(Exception):
    """An argument the key does not describe: launch through Triton."""


@functools.cache
def _runtime() -> tuple[Any, Any, Any] | None:
    """``(knobs.runtime, current_device, current_stream)`` where the fast path can run, else None."""
    try:
        from triton import knobs
        from triton.runtime import driver

        active = driver.active  # resolved here: raises where no GPU driver is active
        return knobs.runtime, active.get_current_device, active.get_current_stream
    except (ImportError, RuntimeError, AttributeError):
        return None


def _hooks_quiet(rt: Any) -> bool:
    """No launch hook is installed (Triton 3.6: ``None``; later: an empty ``HookChain``)."""
    for h in (getattr(rt, "launch_enter_hook", None), getattr(rt, "launch_exit_hook", None)):
        if h is not None and getattr(h, "calls", True):
            return False
    return True


def fast_launch_available() -> bool:
    """Whether :func:`launch` can skip Triton's binding here (CUDA build, no interpreter, no hooks)."""
    from ._backend import interpreting

    rt = _runtime()
    return rt is not None and not interpreting() and _hooks_quiet(rt[0])


class _Site:
    """One ``@triton.jit`` function's parameter table and its compiled kernels by key."""

    __slots__ = ("names", "index", "const", "defaults", "compiled")

    def __init__(self, fn: Any) -> None:
        sig = inspect.signature(fn.fn).parameters  # the Python function's (every Triton version)
        self.names = list(sig)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.const = [_is_constexpr(p.annotation) for p in sig.values()]
        self.defaults = [_MISSING if p.default is p.empty else p.default for p in sig.values()]
        self.compiled: dict[tuple, Any] = {}


_MISSING = object()


def _is_constexpr(annotation: Any) -> bool:
    """As Triton reads a parameter's annotation (``tl.constexpr``, also as a string)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return "constexpr" in text


_SITES: dict[int, _Site] = {}


def clear_launch_cache() -> None:
    """Forget every compiled kernel :func:`launch` kept (tests; Triton keeps its own cache)."""
    _SITES.clear()


def _site(fn: Any) -> _Site:
    s = _SITES.get(id(fn))
    if s is None:
        s = _SITES[id(fn)] = _Site(fn)
    return s


def _spec(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15 == 0)
    t = type(a)
    if t is int:
        return (a == 1, a & 15 == 0, _INT32[0] <= a <= _INT32[1])
    if t is float:
        return float
    if t is bool or a is None:
        return a
    raise _Slow


def _bind(site: _Site, args: tuple, kwargs: dict) -> tuple[list, tuple, tuple]:
    """Values in parameter order, the key of the non-constexpr values, the launch options."""
    n = len(args)
    vals = list(args)
    names = site.names
    if n > len(names):
        raise _Slow
    for i in range(n, len(names)):
        v = kwargs.get(names[i], _MISSING)
        if v is _MISSING:
            v = site.defaults[i]
            if v is _MISSING:
                raise _Slow  # Triton says which argument is missing
        vals.append(v)
    const = site.const
    key = tuple([v if const[i] else _spec(v) for i, v in enumerate(vals)])
    opts = tuple(sorted((k, v) for k, v in kwargs.items() if k not in site.index)) if len(kwargs) else ()
    return vals, key, opts


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)``, re-using the compiled kernel of a seen specialisation.

    Args:
        kernel: a ``@triton.jit`` (or Gluon) function.
        grid: a tuple of 1-3 ints (not a callable).
        args, kwargs: as for ``kernel[grid]``; launch options (``num_warps``, ``launch_pdl``, ...)
            among the keyword arguments.
    Returns:
        The compiled kernel (what ``kernel[grid](...)`` returns).
    """
    rt = _runtime()
    if rt is None or not fast_launch_available():
        return kernel[grid](*args, **kwargs)
    knobs_rt, current_device, current_stream = rt
    site = _site(kernel)
    try:
        vals, key, opts = _bind(site, args, kwargs)
        dev = current_device()
        full = (dev, opts, key)
        compiled = site.compiled.get(full)
    except (_Slow, TypeError):  # TypeError: an unhashable constexpr
        return kernel[grid](*args, **kwargs)
    if compiled is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        site.compiled[full] = compiled
        return compiled
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(
        grid[0], g1, g2, current_stream(dev), compiled.function, compiled.packed_metadata, None,
        knobs_rt.launch_enter_hook, knobs_rt.launch_exit_hook, *vals,
    )  # fmt: skip
    return compiled
