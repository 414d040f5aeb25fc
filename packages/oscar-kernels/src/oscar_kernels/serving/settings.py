"""OSCAR's serving options: one validated object, parsed in one place for every engine.

An engine adapter reads its own configuration section (vLLM: ``additional_config["oscar"]``;
SGLang: the ``--oscar-*`` server arguments) and the process environment once, through
:meth:`ServingSettings.parse`, and hands the object to whatever needs an option. Nothing else
reads ``OSCAR_*`` variables.

| key | type | default | environment fallback |
| --- | --- | --- | --- |
| ``rotations`` | path | (required) | ``OSCAR_ROTATIONS`` |
| ``exclude_layers`` | list of ints | ``[]`` | |
| ``window_records`` | ``auto`` / ``transient`` / ``held`` | ``auto`` | |
| ``radix_cache`` | ``exact`` / ``int2`` / ``off`` | ``exact`` | ``OSCAR_SGLANG_RADIX_CACHE`` |
| ``window_snapshots`` | int ≥ 1 | two per request slot | ``OSCAR_SGLANG_WINDOW_SNAPSHOTS`` |
| ``split_extend`` | bool | ``true`` | ``OSCAR_VLLM_SPLIT_EXTEND`` (0/1) |
| ``dense_prefill`` | bool | ``true`` | ``OSCAR_DENSE_PREFILL`` (0/1) |
| ``warmup`` | bool | the engine's own JIT warm-up setting | ``OSCAR_VLLM_WARMUP`` (0/1) |
| ``identity_restores`` | bool | ``true`` | ``OSCAR_VLLM_V2_IDENTITY_RESTORES`` (0/1) |
| ``step_log`` | path | none | ``OSCAR_VLLM_STEP_LOG`` |
| ``fold_output`` | bool | ``true`` | ``OSCAR_FOLD_OUTPUT`` (0/1) |
| ``overlap_write`` | bool | ``true`` | ``OSCAR_OVERLAP_WRITE`` (0/1) |
| ``overlap_layers`` | bool | ``true`` | ``OSCAR_OVERLAP_LAYERS`` (0/1) |

A key in the section wins over its variable. Every bad value is one :class:`OscarError` line that
names the key (or variable), what it accepts and what it got.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from oscar_math.errors import OscarError

__all__ = ["ServingSettings", "WindowRecords", "RadixCache", "ENV"]


class WindowRecords(str, Enum):
    """How long vLLM keeps a running request's BF16 window records (docs/vllm.md, "Prefix caching")."""

    AUTO = "auto"
    TRANSIENT = "transient"
    HELD = "held"


class RadixCache(str, Enum):
    """What SGLang's radix (prefix) cache does under OSCAR (docs/sglang.md)."""

    OFF = "off"  # the tree is built disabled
    EXACT = "exact"  # hits cut back to prefixes with a window snapshot: a hit equals a miss
    INT2 = "int2"  # any hit; the prefix's window rows rebuilt from INT2 (approximate)


#: the environment variable of each key that has one
ENV = {
    "rotations": "OSCAR_ROTATIONS",
    "radix_cache": "OSCAR_SGLANG_RADIX_CACHE",
    "window_snapshots": "OSCAR_SGLANG_WINDOW_SNAPSHOTS",
    "split_extend": "OSCAR_VLLM_SPLIT_EXTEND",
    "dense_prefill": "OSCAR_DENSE_PREFILL",
    "warmup": "OSCAR_VLLM_WARMUP",
    "identity_restores": "OSCAR_VLLM_V2_IDENTITY_RESTORES",
    "step_log": "OSCAR_VLLM_STEP_LOG",
    "fold_output": "OSCAR_FOLD_OUTPUT",
    "overlap_write": "OSCAR_OVERLAP_WRITE",
    "overlap_layers": "OSCAR_OVERLAP_LAYERS",
}


@dataclass(frozen=True)
class ServingSettings:
    """OSCAR's options for one engine (see the module docstring for each key)."""

    rotations: str
    exclude_layers: tuple[int, ...] = ()
    window_records: WindowRecords = WindowRecords.AUTO
    radix_cache: RadixCache = RadixCache.EXACT
    window_snapshots: int | None = None
    split_extend: bool = True
    #: long prefill chunks through a dense FlashAttention kernel (the engine's, else torch's) that
    #: passed oscar_kernels.check_dense_attention at start-up; false: OSCAR's Triton extend kernel
    dense_prefill: bool = True
    warmup: bool | None = None
    identity_restores: bool = True
    step_log: str | None = None
    #: R_V folded into each INT2 layer's output projection at load time where its weight is a plain
    #: floating-point matrix (oscar_kernels.fold_output_rotation): the attention returns o_rot and
    #: no layer un-rotates; false (or a projection it cannot fold) keeps the un-rotation
    fold_output: bool = True
    #: a decode step's INT2 rows written on a second CUDA stream beside the layer's attention (its
    #: BF16 rows before it, as the attention reads them): serving.run_layer's ``overlap_write``
    overlap_write: bool = True
    #: with ``overlap_write``: in a FULL CUDA graph a decode layer's INT2 pass and window records stay
    #: open past the layer (the next layer joins them: serving.run_layer's ``defer_join``); served
    #: in vLLM on the H100 with its defaults, 1-3 % faster decode steps (docs/performance.md)
    overlap_layers: bool = True

    def __post_init__(self) -> None:
        _exclude_list(list(self.exclude_layers), "exclude_layers")
        if self.window_snapshots is not None and (
            type(self.window_snapshots) is not int or self.window_snapshots < 1
        ):
            raise OscarError(
                f"Invalid window_snapshots: expected an integer >= 1, got {self.window_snapshots!r}"
            )

    @classmethod
    def parse(
        cls,
        section: Mapping[str, Any] | None,
        env: Mapping[str, str],
        where: str = "OSCAR settings",
        require_rotations: bool = True,
    ) -> ServingSettings:
        """The settings from an engine's section (``None``: empty) and the environment ``env``.

        ``where`` names the section in error messages (e.g. ``additional_config["oscar"]``);
        ``require_rotations=False`` for a caller that reads a switch only."""
        sec = dict(section or {})
        unknown = sorted(set(sec) - KEYS)
        if unknown:
            raise OscarError(f"{where} has unknown keys {unknown} (known: {', '.join(sorted(KEYS))})")

        def raw(key: str) -> tuple[Any, str] | None:
            if key in sec and sec[key] is not None:
                return sec[key], f"{where}[{key!r}]"
            var = ENV.get(key)
            if var and env.get(var, "").strip():
                return env[var].strip(), f"${var}"
            return None

        kw: dict[str, Any] = {}
        got = raw("rotations")
        kw["rotations"] = str(got[0]) if got else ""
        if require_rotations and not kw["rotations"]:
            raise OscarError(
                "OSCAR needs a rotations artifact: pass its path (vLLM: --additional-config "
                '\'{"oscar": {"rotations": "FILE"}}\'; SGLang: --oscar-rotations FILE) or set '
                "OSCAR_ROTATIONS=FILE; make one with 'oscar calibrate MODEL --out FILE'"
            )
        if "exclude_layers" in sec:
            kw["exclude_layers"] = _exclude_list(sec["exclude_layers"], f"{where}['exclude_layers']")
        for key, enum in (("window_records", WindowRecords), ("radix_cache", RadixCache)):
            got = raw(key)
            if got:
                kw[key] = _choice(enum, *got)
        got = raw("window_snapshots")
        if got:
            kw["window_snapshots"] = _positive_int(*got)
        for key in SWITCHES:
            got = raw(key)
            if got:
                kw[key] = _switch(*got)
        got = raw("step_log")
        if got:
            kw["step_log"] = str(got[0])
        return cls(**kw)


#: the keys that are true/false switches
SWITCHES = (
    "split_extend", "dense_prefill", "warmup", "identity_restores", "fold_output", "overlap_write",
    "overlap_layers",
)  # fmt: skip

KEYS = frozenset(
    {
        "rotations",
        "exclude_layers",
        "window_records",
        "radix_cache",
        "window_snapshots",
        "split_extend",
        "dense_prefill",
        "warmup",
        "identity_restores",
        "step_log",
        "fold_output",
        "overlap_write",
        "overlap_layers",
    }
)


def _choice(enum: type[Enum], value: Any, name: str) -> Any:
    text = str(value.value if isinstance(value, Enum) else value).strip().lower()
    try:
        return enum(text)
    except ValueError:
        raise OscarError(
            f"Invalid {name}: expected one of {', '.join(e.value for e in enum)}, got {value!r}"
        ) from None


def _switch(value: Any, name: str) -> bool:
    """JSON booleans, or ``0`` / ``1`` (an environment variable's text)."""
    if type(value) is bool:
        return value
    if str(value) in ("0", "1"):
        return str(value) == "1"
    raise OscarError(f"Invalid {name}: expected true/false (or 0/1), got {value!r}")


def _positive_int(value: Any, name: str) -> int:
    try:
        n = int(value) if type(value) is not bool else -1
    except (TypeError, ValueError):
        n = -1
    if n < 1 or (isinstance(value, float) and value != n):
        raise OscarError(f"Invalid {name}: expected an integer >= 1, got {value!r}")
    return n


def _exclude_list(value: Any, name: str) -> tuple[int, ...]:
    """The excluded layers, sorted; one-line errors for a non-list, non-ints and repeats."""
    # bool is an int subclass: `true` in JSON is a mistake, not layer 1
    if not isinstance(value, list | tuple) or not all(type(i) is int for i in value):
        raise OscarError(f"{name} must be a list of layer indices (ints), got {value!r}")
    repeated = sorted({i for i in value if list(value).count(i) > 1})
    if repeated:
        raise OscarError(f"{name} lists layers {repeated} more than once")
    return tuple(sorted(value))
