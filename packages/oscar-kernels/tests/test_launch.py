"""oscar_kernels.launch: a re-used compiled kernel is the one Triton would launch, with the call's values."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, HAS_CUDA, needs_triton

from oscar_kernels import launch as L

pytestmark = needs_triton


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def axpy_kernel(x_ptr, y_ptr, out_ptr, n, stride, alpha, BLOCK: tl.constexpr, SHIFT: tl.constexpr = 0):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        x = tl.load(x_ptr + i * stride, mask=m)
        y = tl.load(y_ptr + i, mask=m)
        tl.store(out_ptr + i, alpha * x + y + SHIFT, mask=m)

    return axpy_kernel


def _key(kernel, *args, **kwargs):
    _, key, opts = L._bind(L._Site(kernel), args, kwargs)
    return tuple(key), opts


def test_key_tells_apart_what_triton_specialises() -> None:
    k = _kernel()
    x = torch.randn(64)
    y = torch.randn(64)
    base = _key(k, x, y, y, 37, 2, 0.5, BLOCK=32)
    assert _key(k, torch.randn(64), torch.randn(64), torch.randn(64), 37, 2, 1.5, BLOCK=32) == base
    assert _key(k, x[1:], y, y, 37, 2, 0.5, BLOCK=32) != base  # 4-byte offset: not 16-byte aligned
    assert _key(k, x.double(), y, y, 37, 2, 0.5, BLOCK=32) != base  # dtype
    assert _key(k, x, y, y, 37, 1, 0.5, BLOCK=32) != base  # an int equal to 1 is a constant to Triton
    assert _key(k, x, y, y, 48, 2, 0.5, BLOCK=32) != base  # a multiple of 16 is an alignment hint
    assert _key(k, x, y, y, 1 << 40, 2, 0.5, BLOCK=32) != base  # int64
    assert _key(k, x, y, y, 37, 2, 0.5, BLOCK=64) != base  # constexpr value
    assert _key(k, x, y, y, 37, 2, 0.5, BLOCK=32, SHIFT=1) != base  # a constexpr default overridden
    assert _key(k, x, y, y, 37, 2, 0.5, BLOCK=32, num_warps=8) != base  # launch option
    assert _key(k, x, y, y, 37, 2, 0.5, BLOCK=32, SHIFT=0) == base  # the default spelt out


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def run(self, *a) -> None:  # noqa: ANN002
        self.calls.append(a)


class _FakeKernel:
    """A kernel whose ``[grid]`` launch is Triton's slow path: counted, returns one compiled kernel
    per distinct key so a wrong re-use shows."""

    def __init__(self, real) -> None:  # noqa: ANN001
        self.fn = real.fn
        self.slow: list[tuple] = []
        self.by_key: dict = {}

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.slow.append((grid, args, kwargs))
            try:
                key = _key(self, *args, **kwargs)
            except L._Slow:
                key = len(self.slow)
            return self.by_key.setdefault(key, _FakeCompiled())

        return run


def _fast_path(monkeypatch: pytest.MonkeyPatch, stream: int) -> None:
    """:func:`launch`'s fast path without a GPU: a runtime with no hooks, device 0, ``stream``."""

    class _Rt:
        launch_enter_hook = launch_exit_hook = None

    monkeypatch.setattr(L, "_runtime", lambda: (_Rt, lambda: 0, lambda dev: stream))
    monkeypatch.setattr(L, "fast_launch_available", lambda: True)


def test_reuses_the_compiled_kernel_of_the_same_key(monkeypatch: pytest.MonkeyPatch) -> None:
    _fast_path(monkeypatch, stream=1234)
    fk = _FakeKernel(_kernel())
    L.clear_launch_cache()
    x, y, o = torch.randn(64), torch.randn(64), torch.randn(64)
    c1 = L.launch(fk, (3,), x, y, o, 37, 2, 0.5, BLOCK=32)
    assert len(fk.slow) == 1 and c1.calls == []  # first: through Triton
    x2 = torch.randn(64)
    c2 = L.launch(fk, (5, 2), x2, y, o, 37, 2, 0.25, BLOCK=32)
    assert c2 is c1 and len(fk.slow) == 1
    # the launcher's arguments: grid, stream, handles, hooks, every value in parameter order
    assert c1.calls == [(5, 2, 1, 1234, "fn", "meta", None, None, None, x2, y, o, 37, 2, 0.25, 32, 0)]
    c3 = L.launch(fk, (3,), x[1:], y, o, 37, 2, 0.5, BLOCK=32)  # unaligned: another specialisation
    assert len(fk.slow) == 2 and c3 is not c1
    L.launch(fk, (3,), x, y, o, 37, 1, 0.5, BLOCK=32)  # stride 1
    assert len(fk.slow) == 3
    L.launch(fk, (3,), x, y, o, 37, 2, 0.5, 32)  # the constexpr passed by position: same key
    assert len(fk.slow) == 3 and len(c1.calls) == 2


def test_hooks_or_unknown_arguments_go_through_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    class _Chain:
        calls = [print]

    class _Rt:
        launch_enter_hook, launch_exit_hook = _Chain(), None

    assert not L._hooks_quiet(_Rt)
    _Rt.launch_enter_hook = type("Empty", (), {"calls": []})()
    assert L._hooks_quiet(_Rt)
    monkeypatch.setattr(L, "_runtime", lambda: (_Rt, lambda: 0, lambda dev: 0))
    monkeypatch.setattr(L, "fast_launch_available", lambda: True)
    fk = _FakeKernel(_kernel())
    L.clear_launch_cache()
    x = torch.randn(64)
    for _ in range(2):
        L.launch(fk, (1,), x, x, x, 37, 2, [0.5], BLOCK=32)  # a list: not in the key's vocabulary
    assert len(fk.slow) == 2


@pytest.mark.parametrize("n", [1, 37, 64, 100])
def test_same_output_as_the_triton_launch(n: int) -> None:
    """Interpreter (CPU): the fallback; CUDA: the re-used kernel's launches, new values each time."""
    import triton

    k = _kernel()
    L.clear_launch_cache()
    gen = torch.Generator().manual_seed(n)
    for rep in range(3):  # the second and third reuse the first's compiled kernel on CUDA
        x = torch.randn(2 * n, generator=gen).to(DEVICE)
        y = torch.randn(n, generator=gen).to(DEVICE)
        want = torch.empty(n, device=DEVICE)
        got = torch.full((n,), float("nan"), device=DEVICE)
        grid = (triton.cdiv(n, 32),)
        k[grid](x, y, want, n, 2, 0.5 + rep, BLOCK=32)
        L.launch(k, grid, x, y, got, n, 2, 0.5 + rep, BLOCK=32)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(got, (0.5 + rep) * x[::2] + y, rtol=1e-6, atol=1e-6)
    if HAS_CUDA:
        assert L.fast_launch_available()
        assert sum(len(s.compiled) for s in L._SITES.values()) == 1


def _count_kernel():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])
    def count_kernel(x_ptr, n, m, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + m, mask=i < n)

    return count_kernel


def test_record_launches_keys_what_triton_compiles_per_and_a_dry_run_launches_nothing():
    """compile_key: an unspecialised int (do_not_specialize) counts by type only, a specialised one
    by value class (1, multiple of 16, other); dry recording runs no kernel. Nested recorders with
    equal contents leave by identity."""
    k = _count_kernel()
    x = torch.zeros(64, device=DEVICE)
    with L.record_launches() as outer:
        with L.record_launches() as keys:
            L.launch(k, (1,), x, 17, 3, BLOCK=64)
            L.launch(k, (1,), x, 48, 5, BLOCK=64)  # n unspecialised (48 = 3·16 counts as 17), m as 3: one key
            L.launch(k, (1,), x, 17, 32, BLOCK=64)  # m a multiple of 16: a second key
            L.launch(k, (1,), x, 17, 1, BLOCK=64)  # m == 1: a third
        assert len(keys) == 3 and keys == outer
        assert x[:17].tolist() == [41.0] * 17 and x[17:48].tolist() == [5.0] * 31
        with L.record_launches(dry=True) as dry:
            assert L.launch(k, (1,), x, 64, 7, BLOCK=64) is None
        assert len(dry) == 1 and dry <= outer
        assert x[:17].tolist() == [41.0] * 17 and x[48:].tolist() == [0.0] * 16  # nothing ran
    assert not L._RECORDERS and not L._DRY


def test_a_dry_run_keeps_each_keys_first_call_and_compile_launches_warms_each_once(monkeypatch):
    """record_launches(dry=True, calls=...) keeps the first call of each compile key (kernel, grid,
    args, kwargs); compile_launches hands each to ``kernel.warmup`` once, with its grid and launch
    options, serially or from a thread pool; nothing under the interpreter."""
    from oscar_kernels import _backend

    k = _count_kernel()
    x = torch.zeros(64, device=DEVICE)
    calls: dict = {}
    with L.record_launches(dry=True, calls=calls) as keys:
        L.launch(k, (1,), x, 17, 3, BLOCK=64)
        L.launch(k, (2,), x, 48, 5, BLOCK=64)  # the same key: not kept again
        L.launch(k, (1,), x, 17, 32, BLOCK=64, num_warps=2)
    assert keys == set(calls) and len(calls) == 2
    first = calls[L.compile_key(k, (x, 17, 3), {"BLOCK": 64})]
    assert first[1] == (1,) and first[2][1:] == (17, 3) and first[3] == {"BLOCK": 64}
    assert not L._CALLS and not L._DRY

    class Fake:
        def __init__(self):
            self.seen = []

        def warmup(self, *args, grid, **kwargs):
            self.seen.append((grid, args, kwargs))

    monkeypatch.setattr(_backend, "interpreting", lambda: False)
    for workers in (1, 3):
        f = Fake()
        assert (
            L.compile_launches([(f, (1,), (x, 5), {"B": 1}), (f, (2, 3), (x, 6), {"num_warps": 2})], workers)
            == 2
        )
        assert sorted(f.seen, key=str) == sorted(
            [((1,), (x, 5), {"B": 1}), ((2, 3), (x, 6), {"num_warps": 2})], key=str
        )
    monkeypatch.setattr(_backend, "interpreting", lambda: True)
    f = Fake()
    assert L.compile_launches([(f, (1,), (x,), {})], 4) == 0 and not f.seen


@pytest.mark.skipif(not HAS_CUDA, reason="compiles for a GPU: needs one")
def test_compiled_ahead_kernels_launch_without_compiling(monkeypatch):
    """compile_launches with threads (Triton's AsyncCompileMode) leaves each kernel in Triton's
    in-memory cache: the real launches afterwards compile nothing (Triton's compile hook stays
    silent) and compute what they should."""
    from triton import knobs

    k = _count_kernel()  # a new jit function: nothing in its in-memory cache
    x = torch.zeros(64, device=DEVICE)
    calls: dict = {}
    with L.record_launches(dry=True, calls=calls):
        for m in (3, 32, 1):
            L.launch(k, (1,), x, 17, m, BLOCK=64)
    assert L.compile_launches(calls.values(), 3) == 3
    compiles = []  # Triton calls the hook before each compile or load from its disk cache
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda *a, **kw: compiles.append(kw) or False)
    for m in (3, 32, 1):
        L.launch(k, (1,), x, 17, m, BLOCK=64)
    torch.cuda.synchronize()
    assert not compiles
    assert x[:17].tolist() == [36.0] * 17


def test_a_launch_sequence_replays_the_first_pass_kernels_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's further layers re-use the compiled kernels of the layer before, position by position,
    without keying; a different kernel at a position is keyed and recorded again."""

    _fast_path(monkeypatch, stream=7)
    a, b = _FakeKernel(_kernel()), _FakeKernel(_kernel())
    L.clear_launch_cache()
    x, y, o = torch.randn(64), torch.randn(64), torch.randn(64)
    keyed = []
    real_bind = L._bind
    monkeypatch.setattr(L, "_bind", lambda *z: keyed.append(1) or real_bind(*z))

    def layer(alpha: float) -> None:
        L.launch(a, (1,), x, y, o, 37, 2, alpha, BLOCK=32)
        L.launch(b, (2,), x, y, o, 37, 2, alpha, BLOCK=64)

    seq = L.LaunchSequence()
    with seq:
        layer(0.5)  # first pass: keyed, compiled through "Triton", recorded
    assert keyed and [k for k, *_ in seq.kernels] == [a, b]
    keyed.clear()
    for alpha in (1.5, 2.5):
        with seq:
            layer(alpha)
    assert keyed == []  # replayed: no key
    ca, cb = seq.kernels[0][-1], seq.kernels[1][-1]
    assert [c[-3] for c in ca.calls] == [1.5, 2.5] and [c[-3] for c in cb.calls] == [1.5, 2.5]
    assert [c[0] for c in cb.calls] == [2, 2]  # each call's own grid
    with seq:  # another order: position 0 is keyed and the rest recorded again
        L.launch(b, (2,), x, y, o, 37, 2, 3.5, BLOCK=64)
        L.launch(a, (1,), x, y, o, 37, 2, 3.5, BLOCK=32)
    assert len(keyed) == 2 and [k for k, *_ in seq.kernels] == [b, a]
    assert L._SEQUENCE == []  # the sequence is left when its block ends


def _opt_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def opt_kernel(x_ptr, n, w_ptr=None, FLAG: tl.constexpr = False):
        i = tl.arange(0, 16)
        x = tl.load(x_ptr + i, mask=i < n)
        if w_ptr is not None:
            x = x * tl.load(w_ptr + i, mask=i < n)
        tl.store(x_ptr + i, x + FLAG, mask=i < n)

    return opt_kernel


def test_a_launch_sequence_keys_one_function_with_other_constexprs(monkeypatch: pytest.MonkeyPatch) -> None:
    """One function at a position picks its compiled kernel by its constexprs, optional pointers and
    launch options too (a decode write's window pass and one-pass write are both
    ``paged_write_kv_kernel``): another value there is keyed, never replayed with the recorded
    kernel (on the H100 a one-pass write replayed the window pass's kernel and wrote no INT2
    codes)."""

    _fast_path(monkeypatch, stream=7)
    a, f = _FakeKernel(_kernel()), _FakeKernel(_opt_kernel())
    L.clear_launch_cache()
    x, y, o, w = torch.randn(64), torch.randn(64), torch.randn(64), torch.randn(64)
    seq = L.LaunchSequence()
    with seq:
        first_a = L.launch(a, (1,), x, y, o, 37, 2, 0.5, BLOCK=32)
        first_f = L.launch(f, (1,), x, 9)
    same_a = dict(BLOCK=32)
    for other_a, other_f in (
        (dict(BLOCK=64), {}),  # a constexpr
        (dict(BLOCK=32, SHIFT=1), {}),  # a constexpr default overridden
        (dict(BLOCK=32, num_warps=8), {}),  # a launch option
        (same_a, dict(FLAG=True)),  # the second position alone: a constexpr default overridden
        (same_a, dict(w_ptr=w)),  # an optional pointer given
        (same_a, dict(launch_pdl=True)),  # a launch option
    ):
        with seq:
            ca = L.launch(a, (1,), x, y, o, 37, 2, 0.5, **other_a)
            cf = L.launch(f, (1,), x, 9, **other_f)
        assert (ca is first_a) == (other_a == same_a) and (cf is first_f) == (not other_f), (other_a, other_f)
        assert ca is a.by_key[_key(a, x, y, o, 37, 2, 0.5, **other_a)]
        assert cf is f.by_key[_key(f, x, 9, **other_f)]
        with seq:  # the first pass's values again: the first compiled kernels
            assert L.launch(a, (1,), x, y, o, 37, 2, 0.5, BLOCK=32) is first_a
            assert L.launch(f, (1,), x, 9, w_ptr=None, FLAG=False) is first_f
    keyed = []
    real_bind = L._bind
    monkeypatch.setattr(L, "_bind", lambda *z: keyed.append(1) or real_bind(*z))
    with seq:  # what the sequence holds now replays without a key (other tensors, another float)
        L.launch(a, (1,), x, y, o, 37, 2, 0.25, BLOCK=32)
        L.launch(f, (1,), y, 9)
    assert keyed == []
