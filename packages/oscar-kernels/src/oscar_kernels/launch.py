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

import contextlib
import functools
import inspect
import operator
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = [
    "launch",
    "clear_launch_cache",
    "fast_launch_available",
    "record_launches",
    "compile_launches",
    "compile_key",
    "LaunchSequence",
]


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

    __slots__ = ("fn", "names", "index", "const", "defaults", "compiled", "fixed", "optional", "options")

    def __init__(self, fn: Any) -> None:
        self.fn = fn  # held: the id that keys this site is never reused while it lives
        sig = inspect.signature(fn.fn).parameters  # the Python function's (every Triton version)
        self.names = list(sig)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.const = [_is_constexpr(p.annotation) for p in sig.values()]
        self.defaults = [_MISSING if p.default is p.empty else p.default for p in sig.values()]
        self.compiled: dict[tuple, Any] = {}
        # what picks a compiled kernel whatever the tensors (:func:`_fixed`): the constexprs (never
        # tensors: one C-level getter) and the optional parameters (a ``None`` default: a pointer
        # Triton specialises as None or not; a bool default), whose tensors are read as "given"
        const = [i for i, c in enumerate(self.const) if c]
        optional = [
            i for i, (c, d) in enumerate(zip(self.const, self.defaults, strict=True))
            if not c and (d is None or type(d) is bool)
        ]  # fmt: skip
        self.fixed = _getter(const)
        self.optional = _getter(optional)
        # the launch options' getter by the call's keyword names (a launcher passes the same ones)
        self.options: dict[tuple, Any] = {}


def _getter(idx: list[int]) -> Any:
    """``operator.itemgetter`` that always returns a tuple."""
    if not idx:
        return lambda _: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda v: (v[i],)
    return operator.itemgetter(*idx)


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


def _values(site: _Site, args: tuple, kwargs: dict) -> list:
    """The call's values in parameter order (keywords and defaults filled in)."""
    names = site.names
    n = len(args)
    if n > len(names):
        raise _Slow
    vals = list(args)
    if n < len(names):
        get, defaults = kwargs.get, site.defaults
        for i in range(n, len(names)):
            v = get(names[i], _MISSING)
            if v is _MISSING:
                v = defaults[i]
                if v is _MISSING:
                    raise _Slow  # Triton says which argument is missing
            vals.append(v)
    return vals


def _fixed(site: _Site, vals: list, kwargs: dict) -> tuple:
    """What picks a call's compiled kernel beside the function, apart from its tensors' dtypes and
    alignment and its ints' specialisation (alike in every layer of a step): the constexpr values,
    the optional arguments (``None`` or not, bools: Triton specialises both) and the launch
    options. Compared as values: a ``None`` optional pointer against a tensor differs."""
    given = tuple([v if v is None or type(v) is bool else 0 for v in site.optional(vals)])
    return site.fixed(vals), given, _options(site, kwargs)


def _bind(site: _Site, args: tuple, kwargs: dict) -> tuple[list, list, tuple]:
    """Values in parameter order, the specialisation key, the launch options.

    The key gets per constexpr its value; per tensor its dtype, then whether its address is
    16-byte aligned; per int 1 for the value 1, else 10 + (multiple of 16) + 2·(within int32);
    per bool 20 + value; per float 30; None as is. A dtype only ever comes from a tensor, so
    every sequence of entries reads back one way. Anything else: :class:`_Slow`.
    """
    vals = _values(site, args, kwargs)
    key: list = []
    put, tensor = key.append, torch.Tensor
    for v, c in zip(vals, site.const, strict=True):
        if c:
            put(v)
            continue
        t = type(v)
        if t is int:
            put(1 if v == 1 else 10 + (not v & 15) + 2 * (-0x80000000 <= v <= 0x7FFFFFFF))
        elif isinstance(v, tensor):
            put(v.dtype)
            put(not v.data_ptr() & 15)
        elif t is bool:
            put(20 + v)
        elif t is float:
            put(30)
        elif v is None:
            put(None)
        else:
            raise _Slow
    return vals, key, _options(site, kwargs)


def _options(site: _Site, kwargs: dict) -> tuple:
    """The call's launch options (``num_warps``, ``launch_pdl``, ...): its keywords that name no
    parameter, as ``(names, values)`` (a C-level getter cached by the call's keyword names: a
    launcher passes the same ones every time)."""
    if not kwargs:
        return ()
    names = tuple(kwargs)
    got = site.options.get(names)
    if got is None:
        keys = tuple([k for k in names if k not in site.index])
        got = site.options[names] = (keys, operator.itemgetter(*keys)) if keys else ()
    return (got[0], got[1](kwargs)) if got else ()


class LaunchSequence:
    """The compiled kernels of one layer's launches, in order, for the other layers of its step.

    An engine step runs the same launches in every layer of one configuration, with arguments of
    the same dtypes, sizes, strides and alignment (the layers' tensors are allocated alike, and
    views into them sit at the same offsets), so Triton would pick the same specialisations. Inside
    ``with seq:`` the first pass records each launch's compiled kernel; later passes re-use them
    in order without computing a specialisation key (:func:`launch`'s key costs more host time
    than the launch). A different kernel at a position — another function, or the same one with
    other constexpr values or launch options (a one-pass write where a window pass was recorded:
    the same ``paged_write_kv_kernel``) — ends the replay there: that position and the rest are
    keyed and recorded again.
    """

    __slots__ = ("kernels", "pos")

    def __init__(self) -> None:
        # (jit function, its site, its constexpr values and launch options, compiled kernel)
        self.kernels: list[tuple[Any, _Site, tuple, Any]] = []
        self.pos = 0

    def __enter__(self) -> LaunchSequence:
        self.pos = 0
        _SEQUENCE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _SEQUENCE.pop()


_SEQUENCE: list[LaunchSequence] = []


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
    if _RECORDERS:
        key = compile_key(kernel, args, kwargs)
        for seen in _RECORDERS:
            seen.add(key)
        if _DRY:
            for calls in _CALLS:
                calls.setdefault(key, (kernel, grid, args, kwargs))
            return None
    rt = _runtime()
    seq = _SEQUENCE[-1] if _SEQUENCE else None
    replay = seq is not None and seq.pos < len(seq.kernels) and seq.kernels[seq.pos][0] is kernel
    # a replayed position was fast-launched before (so no interpreter); only hooks can appear since
    if rt is None or not (_hooks_quiet(rt[0]) if replay else fast_launch_available()):
        return kernel[grid](*args, **kwargs)
    knobs_rt, current_device, current_stream = rt
    dev = current_device()
    if replay:
        _, site, fixed, compiled = seq.kernels[seq.pos]  # a later layer of the step: no key
        try:
            vals = _values(site, args, kwargs)
        except _Slow:
            return kernel[grid](*args, **kwargs)
        # the constexprs and launch options pick the compiled kernel: compared, not keyed (no
        # tensor is looked at); another value ends the replay here
        replay = _fixed(site, vals, kwargs) == fixed
        if replay:
            seq.pos += 1
    if not replay:
        try:
            site = _site(kernel)
            vals, key, opts = _bind(site, args, kwargs)
            full = (dev, opts, *key)
            compiled = site.compiled.get(full)
        except (_Slow, TypeError, AttributeError):  # unhashable value; not a plain jit function (autotuner)
            return kernel[grid](*args, **kwargs)
        if compiled is None:
            compiled = kernel[grid](*args, **kwargs)
            if hasattr(compiled, "result"):  # an asynchronous compile's future
                compiled = compiled.result()
            site.compiled[full] = compiled
            if seq is not None:  # launched by Triton itself; later layers re-use the kernel
                del seq.kernels[seq.pos :]
                seq.kernels.append((kernel, site, _fixed(site, vals, kwargs), compiled))
                seq.pos += 1
            return compiled
        if seq is not None:
            del seq.kernels[seq.pos :]
            seq.kernels.append((kernel, site, _fixed(site, vals, kwargs), compiled))
            seq.pos += 1
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(
        grid[0], g1, g2, current_stream(dev), compiled.function, compiled.packed_metadata, None,
        knobs_rt.launch_enter_hook, knobs_rt.launch_exit_hook, *vals,
    )  # fmt: skip
    return compiled


_RECORDERS: list[set[tuple]] = []
_DRY: list[bool] = []  # non-empty: record_launches(dry=True) is active
_CALLS: list[dict] = []  # record_launches(dry=True, calls=...): each key's first call


@contextlib.contextmanager
def record_launches(dry: bool = False, calls: dict | None = None) -> Iterator[set[tuple]]:
    """Collect the :func:`compile_key` of every :func:`launch` in the block (also under Triton's
    interpreter): what a warm-up must have launched for serving to compile nothing.

    ``dry``: record without launching (host work only; :func:`launch` returns None), to find
    which of many calls compile differently before running one of each. ``calls`` (with ``dry``):
    also keep each key's first call ``(kernel, grid, args, kwargs)`` there, for
    :func:`compile_launches`.
    """
    seen: set[tuple] = set()
    _RECORDERS.append(seen)
    if dry:
        _DRY.append(True)
        if calls is not None:
            _CALLS.append(calls)
    try:
        yield seen
    finally:
        # by identity: two recorders may hold equal sets
        del _RECORDERS[next(i for i, r in enumerate(_RECORDERS) if r is seen)]
        if dry:
            _DRY.pop()
            if calls is not None:
                del _CALLS[next(i for i, c in enumerate(_CALLS) if c is calls)]


def compile_launches(calls: Iterable[tuple[Any, Any, tuple, dict]], workers: int) -> int:
    """Compile, without running, each ``(kernel, grid, args, kwargs)`` call (as
    :func:`record_launches` kept them), ``workers`` at a time; returns how many were compiled.

    Through Triton's own asynchronous compile (``AsyncCompileMode`` with a thread pool, and each
    call's ``kernel.warmup``): its compiles spend most of their time outside the GIL (MLIR passes,
    ``ptxas``), so threads overlap them (two threads on two cores: 23.6 → 12.0 s for four of
    OSCAR's kernels for sm_90). The kernels land in Triton's caches, in memory and on disk, as a
    launch would leave them. Serially where that mode is missing (older Triton), under the
    interpreter (nothing to compile) or with ``workers <= 1``."""
    from ._backend import interpreting

    calls = list(calls)
    if not calls or interpreting():
        return 0
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        AsyncCompileMode = None  # noqa: N806 - the class, where this Triton has it
    if AsyncCompileMode is None or workers <= 1:
        for kernel, grid, args, kwargs in calls:
            kernel.warmup(*args, grid=grid, **kwargs)
        return len(calls)
    with ThreadPoolExecutor(workers, thread_name_prefix="oscar-compile") as pool, AsyncCompileMode(pool):
        for kernel, grid, args, kwargs in calls:
            kernel.warmup(*args, grid=grid, **kwargs)
    return len(calls)


def _unspecialised(kernel: Any, names: list[str]) -> tuple[frozenset[str], frozenset[str]]:
    """The parameters ``kernel`` does not specialise on value / on alignment (``@triton.jit``'s
    ``do_not_specialize*``; Triton's interpreter keeps them in ``kwargs``)."""
    opts = getattr(kernel, "kwargs", None) or {}
    out = []
    for attr in ("do_not_specialize", "do_not_specialize_on_alignment"):
        given = getattr(kernel, attr, None) or opts.get(attr) or ()
        out.append(frozenset(names[g] if isinstance(g, int) else g for g in given))
    return out[0], out[1]


def compile_key(kernel: Any, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles ``kernel`` per: its name, each constexpr's value, each tensor's dtype
    and 16-byte alignment, each int's value class (1, a multiple of 16, other; int32 or wider),
    each bool's value, and the launch options. Parameters the kernel does not specialise on
    (``do_not_specialize``) count by type only. Coarser than :func:`launch`'s fast key, never
    finer than Triton's own (so two calls with one key never compile twice)."""
    site = _site(kernel)
    key: list = [getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))]
    try:
        vals = _values(site, args, kwargs)
    except _Slow:  # Triton itself will say what is wrong with the call
        return (*key, "unbound")
    opts = tuple((k, v) for k, v in kwargs.items() if k not in site.index)
    no_value, no_align = _unspecialised(kernel, site.names)
    for name, v, c in zip(site.names, vals, site.const, strict=True):
        if c:
            key.append(v)
        elif isinstance(v, torch.Tensor):
            key.append((v.dtype, name in no_align or not v.data_ptr() & 15))
        elif type(v) is int:
            wide = not -0x80000000 <= v <= 0x7FFFFFFF
            key.append(("int", wide) if name in no_value else ("int", v == 1, not v & 15, wide))
        elif type(v) is bool:
            key.append(("bool", v))
        else:
            key.append(type(v).__name__)
    return (*key, opts)
