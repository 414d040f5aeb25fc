"""Clip powers per block of layers, chosen by the model's own KL through the emulated cache.

The row search (:mod:`oscar_calib.calibrate`) finds, per layer and KV head, the clip ratio
``α`` that minimises each row's own quantisation error; the stored ratio is ``α ** p``. One
global ``p`` (keys 0.7, values 0.5) was chosen end to end because no local error ranks
ratios the way the model does (docs/results.md, "Long context": per-head ratios chosen by
the attention-output error or its Fisher weighting both lost end to end).

This module keeps the end-to-end objective and only adds free parameters where few
sequences can still pin them down: the layers are cut into ``blocks`` contiguous blocks and
each block gets its own key power and value power, chosen by coordinate descent on the mean
KL(bf16 ‖ quantised) of the calibration sequences, with the cache emulated exactly as
``oscar eval`` serves it (:func:`oscar_calib.simulate.simulate`, sink and recent windows
exact). Rotations, key mean, format and bits are untouched: the artifact stores ``α ** p_l``
per layer, and its metadata records the powers (``clip_power_per_layer``) so ablations can
undo them.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from oscar_math.errors import check

from .metrics import final_hidden, sequences_metrics
from .schemes import SchemeContext, build_scheme
from .simulate import Windows, simulate

__all__ = [
    "K_POWER_GRID",
    "V_POWER_GRID",
    "PowerSearchResult",
    "apply_clip_powers",
    "layer_blocks",
    "mean_kl",
    "search_clip_powers",
]

#: candidate key powers (the stored ratio is ``searched ** p``; larger p clips harder)
K_POWER_GRID: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
#: candidate value powers (the value power mattered little globally: a coarser grid)
V_POWER_GRID: tuple[float, ...] = (0.3, 0.5, 0.7, 1.0)


@dataclass
class PowerSearchResult:
    """What :func:`search_clip_powers` chose.

    Attributes:
        k_power, v_power: one power per layer.
        kl_start: objective (mean KL, nats) of the uniform start powers.
        kl_chosen: objective of the chosen powers (``<= kl_start``).
        evaluations: objective evaluations done (each one forward per sequence).
        complete: False when ``deadline_s`` stopped the descent early (the best so far is kept).
        trace: one entry per accepted move: ``{"kind", "block", "power", "kl"}``.
    """

    k_power: tuple[float, ...]
    v_power: tuple[float, ...]
    kl_start: float
    kl_chosen: float
    evaluations: int
    complete: bool
    trace: list[dict[str, Any]] = field(default_factory=list)


def layer_blocks(num_layers: int, blocks: int) -> list[range]:
    """``num_layers`` cut into ``blocks`` contiguous ranges whose sizes differ by at most one.

    Raises:
        OscarError: ``blocks`` not an integer in ``[1, num_layers]``.
    """
    ok = isinstance(blocks, int) and not isinstance(blocks, bool) and 1 <= blocks <= num_layers
    check(ok, "blocks", f"an integer in [1, {num_layers}] (the number of layers)", blocks)
    base, extra = divmod(num_layers, blocks)
    out, start = [], 0
    for b in range(blocks):
        size = base + (1 if b < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def apply_clip_powers(searched: Any, k_power: Sequence[float], v_power: Sequence[float]) -> Any:
    """Rotations whose stored ratios are ``searched ** power`` per layer.

    Args:
        searched: :class:`oscar_math.artifact.Rotations` holding the *searched* ratios ``α``
            (calibrated with ``clip_power = value_clip_power = 1``).
        k_power, v_power: one power per layer, each in ``(0, 1]``.

    The metadata records the powers (``clip_power_per_layer``) and drops the scalar
    ``clip_power``/``value_clip_power`` so that no reader undoes a single power.
    """
    n = searched.num_layers
    for name, powers in (("k_power", k_power), ("v_power", v_power)):
        check(len(powers) == n, name, f"{n} powers (one per layer)", len(powers))
        bad = [p for p in powers if not (isinstance(p, (int, float)) and 0.0 < p <= 1.0)]
        check(not bad, name, "powers in (0, 1]", bad[:1])
    meta = dict(searched.calibration or {})
    for key in ("clip_power", "value_clip_power", "clip_error_ratio"):
        meta.pop(key, None)
    meta["clip_power_per_layer"] = {"k": [float(p) for p in k_power], "v": [float(p) for p in v_power]}
    return dataclasses.replace(
        searched,
        k_clip=tuple(c.clamp(min=1e-6) ** float(p) for c, p in zip(searched.k_clip, k_power, strict=True)),
        v_clip=tuple(c.clamp(min=1e-6) ** float(p) for c, p in zip(searched.v_clip, v_power, strict=True)),
        calibration=meta,
    )


def _references(model: Any, seqs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    device = next(model.parameters()).device
    refs = []
    for seq in seqs:
        ids = seq[None].to(device)
        refs.append((ids, final_hidden(model, ids)[0]))
    return refs


def mean_kl(
    model: Any,
    rotations: Any,
    refs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    windows: Windows,
) -> float:
    """Mean over sequences of the per-position mean KL(bf16 ‖ ``oscar2`` with ``rotations``).

    ``refs``: ``(input_ids [1, T], reference final hidden [T, hidden])`` per sequence.
    ``oscar2`` rounds with the artifact's error-feedback matrices where it stores them
    (``calibrate`` computes them before the search), so the candidates are scored with the
    codes engines serve, not plain rounding.
    """
    info_hd = rotations.head_dim
    scheme = build_scheme(
        "oscar2", SchemeContext(info_hd, rotations.num_layers, rotations.num_kv_heads, rotations)
    )
    kls = []
    for ids, ref in refs:
        with simulate(model, scheme, windows):
            hid = final_hidden(model, ids)[0]
        kls.append(sequences_metrics(model, ref, {"q": hid}, ids[0])["q"].kl)
    return sum(kls) / len(kls)


def search_clip_powers(
    model: Any,
    searched: Any,
    seqs: Sequence[torch.Tensor],
    *,
    windows: Windows | None = None,
    blocks: int = 6,
    start: tuple[float, float] = (0.7, 0.5),
    k_grid: Sequence[float] = K_POWER_GRID,
    v_grid: Sequence[float] = V_POWER_GRID,
    sweeps: int = 1,
    min_gain: float = 0.0,
    deadline_s: float | None = None,
    progress: bool = False,
) -> PowerSearchResult:
    """Coordinate descent over per-block key and value clip powers by end-to-end KL.

    Starting from the uniform ``start = (key power, value power)``, each sweep visits the
    key power of every block, then the value power of every block, trying every other grid
    value and keeping the one with the lowest objective (a move is kept only if it lowers the
    objective by more than ``min_gain`` relative). The objective is :func:`mean_kl` on
    ``seqs`` (calibration sequences, never evaluation ones).

    Args:
        model: the causal LM (any dtype/device; sequences are moved to its device).
        searched: rotations with the searched ratios ``α`` (powers 1).
        seqs: LongTensor ``[T]`` sequences longer than the BF16 windows.
        blocks: contiguous layer blocks, one key and one value power each.
        deadline_s: stop after this many seconds (keeping the best so far; ``complete=False``).

    Raises:
        OscarError: bad blocks, powers, grids or sequences.
    """
    windows = windows or Windows()
    check(len(seqs) >= 1, "seqs", "at least one sequence", len(seqs))
    short = [int(s.numel()) for s in seqs if s.numel() <= windows.sink + windows.recent + 1]
    check(
        not short,
        "seqs",
        f"sequences longer than the BF16 windows ({windows.sink}+{windows.recent} tokens)",
        short[:1],
    )
    for name, grid in (("k_grid", k_grid), ("v_grid", v_grid)):
        check(
            len(grid) >= 1 and all(isinstance(p, (int, float)) and 0.0 < p <= 1.0 for p in grid),
            name,
            "powers in (0, 1]",
            list(grid),
        )
    check(isinstance(sweeps, int) and sweeps >= 1, "sweeps", "an integer >= 1", sweeps)
    n = searched.num_layers
    ranges = layer_blocks(n, blocks)
    powers = {"k": [float(start[0])] * n, "v": [float(start[1])] * n}
    t0 = time.perf_counter()
    refs = _references(model, seqs)

    def objective() -> float:
        return mean_kl(model, apply_clip_powers(searched, powers["k"], powers["v"]), refs, windows)

    best = objective()
    kl_start, evaluations, complete = best, 1, True
    trace: list[dict[str, Any]] = []
    for _ in range(sweeps):
        for kind, grid in (("k", k_grid), ("v", v_grid)):
            for b, layers in enumerate(ranges):
                current = powers[kind][layers[0]]
                choice = current
                for p in grid:
                    if math.isclose(p, current):
                        continue
                    if deadline_s is not None and time.perf_counter() - t0 > deadline_s:
                        complete = False
                        break
                    for i in layers:
                        powers[kind][i] = float(p)
                    kl = objective()
                    evaluations += 1
                    if kl < best * (1.0 - min_gain):
                        best, choice = kl, float(p)
                    if progress:
                        msg = f"power search {kind} block {b} p={p}: KL {kl:.5f} (best {best:.5f})"
                        print(msg, file=sys.stderr)
                for i in layers:
                    powers[kind][i] = choice
                if choice != current:
                    trace.append({"kind": kind, "block": b, "power": choice, "kl": best})
                if not complete:
                    break
            if not complete:
                break
        if not complete:
            break
    return PowerSearchResult(
        k_power=tuple(powers["k"]),
        v_power=tuple(powers["v"]),
        kl_start=kl_start,
        kl_chosen=best,
        evaluations=evaluations,
        complete=complete,
        trace=trace,
    )
