"""Calibration: text → statistics → rotations, key means and clip ratios → the artifact.

For each layer (and KV head with ``granularity="kv_head"``):

* keys: ``R_K = compose_rotation(eigenbasis(C_Q).U, group_size)``; with ``rope_pairs``
  (format version 3, :mod:`oscar_math.rope_center`) the pre-RoPE key mean ``m`` on the
  selected frequency pairs is subtracted per position first (``k − RoPE_p(m)``), and
  everything below is computed on those residual keys; the key mean ``μ`` (positions past
  the sink) is subtracted before rotating when ``key_centering``;
  the clip ratio minimises the expected logit error ``E_q[(qᵀ(k − k̂))²]`` on sampled
  rows ``(k − μ) @ R_K`` with metric ``R_Kᵀ C_Q R_K``;
* values: ``R_V = compose_rotation(eigenbasis(C_S).U, group_size)``; the clip ratio
  minimises the attention-weighted error on sampled rows ``v @ R_V`` with each row
  weighted by the attention it receives (``Σ_t S_ts²``).

All statistics come from one streamed pass (:mod:`oscar_calib.capture`).
"""

from __future__ import annotations

import contextlib
import json
import platform
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from oscar_math.artifact import DEFAULT_RECENT, DEFAULT_SINK, Granularity, Rotations
from oscar_math.clipping import clip_error, search_clip_ratio
from oscar_math.eigen import eigenbasis
from oscar_math.errors import check
from oscar_math.feedback import feedback_matrix
from oscar_math.hadamard import is_hadamard_order
from oscar_math.rope_center import rope_position_mean
from oscar_math.rotation import HadamardMode, compose_rotation

from .capture import CalibrationStatistics, collect_statistics
from .models import model_info
from .text import BUILTIN_TEXT, load_text, split_text, token_chunks

__all__ = [
    "CalibrationConfig",
    "calibrate",
    "calibration_chunks",
    "refine_clip_by_output",
    "refine_clip_powers_by_kl",
    "rotations_from_statistics",
    "search_chunks",
    "select_rope_pairs",
    "tool_version",
]

CONFIG_VERSION = 1
#: how stored clip ratios are chosen (CalibrationConfig.clip_search)
CLIP_SEARCHES = ("output", "row", "kl")
#: which rows are written with error-feedback codes (CalibrationConfig.feedback)
FEEDBACK_MODES = ("none", "k", "v", "kv")
#: default ``rope_pairs`` (CalibrationConfig): 8. The H200 study (lab/calib_studies/rope_study.py,
#: docs/results.md
#: "sixth study") ranked 16 first on the calibration split (mean KL 0.0146 vs 0.0157 for 8, 0.0201 without),
#: but its decode score term costs x1.48-1.57 at 32k-128k against x1.04-1.20 for 8 (docs/kernels.md);
#: on held-out text 8 and 16 are within 1-7 % in KL. ``--rope-pairs 16`` for accuracy first, 0 for format 2.
ROPE_PAIRS_DEFAULT: int | str = 8
#: default key clip power with plain rounding (chosen in issue 13's first study) and with
#: error-feedback key codes (milder clipping: feedback spreads the rounding error into
#: directions queries do not read, so clipping buys less; docs/results.md, fourth study)
KEY_CLIP_POWER_PLAIN = 0.7
KEY_CLIP_POWER_FEEDBACK = 0.5


def tool_version() -> str:
    """``oscar-calib`` version string recorded in artifacts."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("oscar-calib")
    except PackageNotFoundError:  # running from a source tree, not installed
        from . import __version__

        return __version__


@dataclass(frozen=True)
class CalibrationConfig:
    """What to calibrate on and how.

    Attributes:
        tokens: calibration tokens (rounded down to whole ``seq_len`` chunks, at least one).
        seq_len: tokens per chunk (one forward pass each); must exceed ``sink`` and fit the
            model's context. 4096 by default: the stored key mean is a mean of keys after RoPE,
            which depends on the positions averaged, so the chunk length trades short against
            long contexts; 4096 kept 2k where 1024 had it and cut the 4k/8k error
            (docs/results.md, "Long context, third study").
        granularity: ``"kv_head"`` (one rotation and clip ratio per KV head) or ``"layer"``.
        group_size: quantisation group along the head dim; ``None`` = the head dim.
        seed: chooses chunks and sampled rows; same seed → identical artifact.
        text: a ``.txt``/``.jsonl`` file, or ``None`` for the built-in corpus. Only the
            calibration part of :func:`oscar_calib.text.split_text` is used; the held-out
            part is left for evaluation.
        heldout_fraction: share of the text kept out of calibration.
        sink: leading BF16 tokens (the serving layout's sink window).
        recent: trailing BF16 tokens (recorded in the artifact for the serving layout).
        key_centering: subtract and store the calibrated key mean ``k_mean``.
        clip: search clip ratios (``False`` stores 1.0, no clipping).
        clip_power: the stored key ratio is ``searched ** clip_power``; 1 stores the search
            result as it is. The search minimises a per-row error, which the end-to-end optimum
            does not follow: 0.7 was chosen on the calibration split at 2k and 8k context
            (it was 0.5 before, chosen at 2k; milder clipping loses more at long context) and
            confirmed on held-out text — docs/results.md, "Long context". ``None`` (default):
            0.7 with plain key rounding, 0.5 with error-feedback key codes (``feedback`` "k" or
            "kv"; chosen on the calibration split and confirmed on held-out text, fourth study).
        value_clip_power: the same for values (``None``: ``clip_power``); 0.5 by default.
        key_clip_objective: ``"logit"`` weighs every sampled key row alike in the expected
            logit error; ``"attention"`` weighs each row by the attention its token receives
            (``Σ_t S_ts²``, the weight the value search uses), so the rare keys attention
            relies on dominate the choice.
        clip_search: ``"row"`` (default) stores the tempered row-search ratios
            ``alpha ** clip_power``; ``"output"`` refines each KV head's key, then value ratio on
            a grid by the error of that head's attention output under the serving windows, on
            ``search_seqs`` calibration sequences of ``search_context`` tokens, starting from
            the tempered row-search ratios (:mod:`oscar_calib.output_clip`; measured worse end
            to end, docs/results.md "Long context, second study");
            ``"kl"``: one key and one value power per block of layers (``power_blocks``), chosen
            from ``clip_power``/``value_clip_power`` by coordinate descent on the model's own KL
            through the emulated cache, on the search sequences
            (:mod:`oscar_calib.power_search`); stores ``alpha ** p_layer``.
        search_context: tokens per sequence of the output or KL search (at most the model's
            context length).
        search_seqs: sequences of the output or KL search.
        power_blocks: contiguous layer blocks of the KL search (at most the number of layers).
        search_row_stride: the output search scores every n-th query row.
        search_weighting: the output search's error of a row's attention output: ``"o_proj"``
            (``W_hᵀ W_h``: what the residual stream receives) or ``"fisher"`` (the empirical
            Fisher ``(gᵀ Δo)²``, ``g`` the next-token loss gradient w.r.t. the output; one
            backward pass per search sequence).
        bit_reversal: bit-reversal permutation of eigen-directions into groups.
        hadamard: ``"group"``, ``"full"`` or ``"none"`` (see ``compose_rotation``).
        max_samples: token rows kept per layer for the clip search.
        feedback: which rows are written with error-feedback (LDLQ) codes
            (:mod:`oscar_math.feedback`): ``"k"``, ``"v"``, ``"kv"`` or ``"none"``. Keys use the
            logit metric ``R_Kᵀ C_Q R_K``, values ``R_Vᵀ (Σ_{h in group} W_hᵀ W_h) R_V`` (the
            group's ``o_proj`` slices). Same scale, zero, clip and bits; the artifact stores the
            feedback matrices (format version 2) so every write path computes the same codes.
        feedback_damp: relative diagonal loading of the metric before its factorisation.
        rope_pairs: position-dependent key centering (artifact format version 3,
            :mod:`oscar_math.rope_center`): the pre-RoPE key mean ``m`` is kept on this many
            frequency pairs per layer — an int ``R`` (the ``R`` pairs with the most
            query-weighted key-mean energy a static mean cannot remove, :func:`select_rope_pairs`),
            ``"all"`` (every pair), or 0 (off: no pre-RoPE mean, format version 1/2). Needs
            ``key_centering``; the static ``k_mean`` is then the mean of the residual keys.
            ``None`` (default): :data:`ROPE_PAIRS_DEFAULT` with key centering and a model whose
            RoPE is static (:data:`oscar_calib.rope_mean.STATIC_ROPE_TYPES`), else 0 (see
            :attr:`resolved_rope_pairs`); an explicit non-zero value refuses other models.
    """

    tokens: int = 16384
    seq_len: int = 4096
    granularity: str = "kv_head"
    group_size: int | None = None
    seed: int = 0
    text: str | None = None
    heldout_fraction: float = 0.2
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    key_centering: bool = True
    clip: bool = True
    clip_power: float | None = None
    value_clip_power: float | None = 0.5
    key_clip_objective: str = "logit"
    clip_search: str = "row"
    search_context: int = 8192
    search_seqs: int = 2
    search_row_stride: int = 32
    search_weighting: str = "o_proj"
    power_blocks: int = 6
    bit_reversal: bool = True
    hadamard: str = "group"
    max_samples: int = 2048
    feedback: str = "k"
    feedback_damp: float = 0.01
    rope_pairs: int | str | None = None
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        if self.clip_power is None:  # the default depends on how the key codes are rounded
            default = KEY_CLIP_POWER_FEEDBACK if "k" in str(self.feedback) else KEY_CLIP_POWER_PLAIN
            object.__setattr__(self, "clip_power", default)

        def _int(name: str, low: int) -> None:
            v = getattr(self, name)
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= low
            check(ok, name, f"an integer >= {low}", v)

        _int("seq_len", 2)
        _int("tokens", 1)
        _int("seed", 0)
        _int("sink", 0)
        _int("recent", 0)
        _int("max_samples", 1)
        _int("search_context", 2)
        _int("search_seqs", 1)
        _int("search_row_stride", 1)
        _int("power_blocks", 1)
        check(self.clip_search in CLIP_SEARCHES, "clip_search", f"one of {CLIP_SEARCHES}", self.clip_search)
        weightings = ("o_proj", "fisher")
        check(
            self.search_weighting in weightings,
            "search_weighting",
            f"one of {weightings}",
            self.search_weighting,
        )
        check(
            self.tokens >= self.seq_len, "tokens", f"at least seq_len={self.seq_len} (one chunk)", self.tokens
        )
        check(self.seq_len > self.sink, "seq_len", f"more than sink={self.sink} tokens", self.seq_len)
        granularities = tuple(g.value for g in Granularity)
        check(self.granularity in granularities, "granularity", f"one of {granularities}", self.granularity)
        if self.group_size is not None:
            _int("group_size", 4)
        check(
            0.0 < self.heldout_fraction < 1.0,
            "heldout_fraction",
            "a number in (0, 1)",
            self.heldout_fraction,
        )
        modes = tuple(m.value for m in HadamardMode)
        check(self.hadamard in modes, "hadamard", f"one of {modes}", self.hadamard)
        check(
            isinstance(self.clip_power, (int, float)) and 0.0 < self.clip_power <= 1.0,
            "clip_power",
            "a number in (0, 1]",
            self.clip_power,
        )
        if self.value_clip_power is not None:
            check(
                isinstance(self.value_clip_power, (int, float)) and 0.0 < self.value_clip_power <= 1.0,
                "value_clip_power",
                "a number in (0, 1] or None",
                self.value_clip_power,
            )
        objectives = ("logit", "attention")
        check(
            self.key_clip_objective in objectives,
            "key_clip_objective",
            f"one of {objectives}",
            self.key_clip_objective,
        )
        check(self.feedback in FEEDBACK_MODES, "feedback", f"one of {FEEDBACK_MODES}", self.feedback)
        check(
            isinstance(self.feedback_damp, (int, float)) and self.feedback_damp > 0,
            "feedback_damp",
            "a number > 0",
            self.feedback_damp,
        )
        r = self.rope_pairs
        ok = r is None or r == "all" or (isinstance(r, int) and not isinstance(r, bool) and r >= 0)
        check(ok, "rope_pairs", "an integer >= 0, 'all' or None", r)
        check(
            self.key_centering or not r,
            "rope_pairs",
            "0 without key_centering (the pre-RoPE mean is part of the key centering)",
            r,
        )
        for name in ("key_centering", "clip", "bit_reversal"):
            check(isinstance(getattr(self, name), bool), name, "True or False", getattr(self, name))

    @property
    def resolved_rope_pairs(self) -> int | str:
        """``rope_pairs`` with the default filled in (:data:`ROPE_PAIRS_DEFAULT` with key
        centering, else 0); calibration falls back to 0 for a default on a model whose RoPE
        is not static."""
        if self.rope_pairs is None:  # the pre-RoPE mean is part of the key centering
            return ROPE_PAIRS_DEFAULT if self.key_centering else 0
        return self.rope_pairs

    def resolved_group_size(self, head_dim: int) -> int:
        """``group_size`` checked against a model's head dim (default: the head dim)."""
        gs = head_dim if self.group_size is None else self.group_size
        check(head_dim % gs == 0, "group_size", f"a divisor of head_dim {head_dim}", gs)
        if self.hadamard == HadamardMode.GROUP.value:
            check(is_hadamard_order(gs), "group_size", "a Hadamard order (e.g. 32, 64, 128)", gs)
        elif self.hadamard == HadamardMode.FULL.value:
            check(is_hadamard_order(head_dim), "head_dim", "a Hadamard order for hadamard='full'", head_dim)
        return gs


def calibration_chunks(tokenizer: Any, config: CalibrationConfig) -> tuple[list[torch.Tensor], str]:
    """The token chunks calibration runs on, and a description of their source.

    Returns:
        ``(chunks, source)``: LongTensor ``[seq_len]`` chunks from the calibration part of
        the text; ``source`` is ``"pydoc_data.topics (Python X.Y.Z)"`` or the file path.
    """
    text = load_text(config.text)
    calibration_text, _ = split_text(text, config.heldout_fraction)
    chunks = token_chunks(tokenizer, calibration_text, config.seq_len, config.tokens, config.seed)
    # the built-in corpus is the running CPython's help topics, which change between releases (even
    # patch releases): the version says which text an artifact was fitted on
    builtin = f"{BUILTIN_TEXT} (Python {platform.python_version()})"
    source = builtin if config.text is None else str(Path(config.text).expanduser())
    return chunks, source


def _rotation(
    cov: torch.Tensor, group_size: int, config: CalibrationConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cov [G, d, d]`` → ``(R [G, d, d] float64, eigenvalues [G, d] float64)``."""
    eigenvalues, U = eigenbasis(cov)
    R = compose_rotation(U, group_size, bit_reversal=config.bit_reversal, hadamard=config.hadamard)
    return R, eigenvalues.clamp(min=0.0)


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    """Run torch ops on one intra-op thread inside the block (restored afterwards).

    Deriving the artifact is hundreds of small tensor ops per layer (the clip search on
    a few MB of sampled rows); with several threads each op pays a fork/join that costs
    more than the op, and far more on a busy machine: on 2 shared cores one thread took
    the step from 35 s to 2 s of CPU time (docs/calibration.md).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[N, H_kv, ...]`` rows → ``[N', G, ...]`` samples (``G = 1`` folds the heads into N)."""
    if groups == 1:
        return x.reshape(x.shape[0] * x.shape[1], 1, *x.shape[2:])
    return x


def _group_metric(per_head: torch.Tensor, num_kv_heads: int, groups: int) -> torch.Tensor:
    """``[H_q, d, d]`` per-query-head metrics → ``[G, d, d]``: summed over each KV head's query
    heads (``G = H_kv``) or over all heads (``G = 1``)."""
    hq, d = per_head.shape[0], per_head.shape[-1]
    m = per_head.double().reshape(num_kv_heads, hq // num_kv_heads, d, d).sum(1)
    return m.sum(0, keepdim=True) if groups == 1 else m


_ROPE_RULE = "top pairs by sum_groups (E q_i^2 + E q_{i+d/2}^2) |m_i|^2 (1 - |mean_p e^{i p theta_i}|^2)"


def _phase_mean(inv_freq: torch.Tensor, first: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mean_p cos(p·θ), mean_p sin(p·θ))`` over positions ``first .. end-1``, ``[d/2]`` float64."""
    ang = torch.arange(first, end, dtype=torch.float64)[:, None] * inv_freq.double()[None, :]
    return ang.cos().mean(0), ang.sin().mean(0)


def select_rope_pairs(
    mean: torch.Tensor,
    query_energy: torch.Tensor,
    inv_freq: torch.Tensor,
    positions: tuple[int, int],
    rope_pairs: int | str,
) -> torch.Tensor:
    """The frequency pairs whose pre-RoPE key mean is kept (``CalibrationConfig.rope_pairs``).

    Pair ``i`` (coordinates ``i`` and ``i + d/2``) is scored by the query-weighted energy of
    the mean that a *static* (post-RoPE) mean cannot remove over the calibration positions::

        score_i = Σ_groups (E q_i² + E q_{i+d/2}²) · (m_i² + m_{i+d/2}²) · (1 − |mean_p e^{i p θ_i}|²)

    (the static mean removes ``|mean_p e^{ipθ}|²`` of the pair's mean energy; the rest is what
    centering by ``RoPE_p(m)`` adds). The top ``rope_pairs`` pairs win, ``"all"`` keeps every pair.

    Args:
        mean: ``[G, d]`` pre-RoPE key mean.
        query_energy: ``[G, d]`` ``E q²`` per coordinate (the diagonal of ``C_Q``).
        inv_freq: ``[d/2]``; positions: ``(first, end)`` averaged over.
        rope_pairs: an int ``>= 0`` or ``"all"``.
    Returns:
        Sorted int64 pair indices.
    """
    half = mean.shape[-1] // 2
    if rope_pairs == "all":
        return torch.arange(half)
    r = min(int(rope_pairs), half)
    c, s = _phase_mean(inv_freq, *positions)
    m2 = mean.double().square()
    qe = query_energy.double()
    score = ((qe[:, :half] + qe[:, half:]) * (m2[:, :half] + m2[:, half:])).sum(0) * (
        1 - c.square() - s.square()
    )
    return score.topk(r).indices.sort().values


def _rope_residual_mean(m: torch.Tensor, inv_freq: torch.Tensor, positions: tuple[int, int]) -> torch.Tensor:
    """``mean_p RoPE_p(m)`` over positions ``first .. end-1`` for ``m [G, d]`` (float64)."""
    c, s = _phase_mean(inv_freq, *positions)
    c2, s2 = torch.cat((c, c)), torch.cat((s, s))
    half = m.shape[-1] // 2
    md = m.double()
    return md * c2 + torch.cat((-md[..., half:], md[..., :half]), dim=-1) * s2


def rotations_from_statistics(
    stats: CalibrationStatistics,
    config: CalibrationConfig,
    *,
    model: str,
    calibration: dict[str, Any] | None = None,
) -> Rotations:
    """Derive the artifact from collected statistics (no model needed).

    Args:
        stats: from :func:`oscar_calib.capture.collect_statistics`.
        config: granularity, group size, rotation and clipping choices.
        model: model identifier stored in the artifact.
        calibration: provenance stored in the artifact metadata.
    """
    info = stats.info
    gs = config.resolved_group_size(info.head_dim)
    g = 1 if config.granularity == Granularity.LAYER.value else info.num_kv_heads
    out: dict[str, list[torch.Tensor]] = {
        k: []
        for k in (
            "k_rotation",
            "v_rotation",
            "k_eigenvalues",
            "v_eigenvalues",
            "k_clip",
            "v_clip",
            "k_mean",
            "k_feedback",
            "v_feedback",
        )
    }
    if "v" in config.feedback:
        check(
            stats.output_metrics is not None,
            "statistics.output_metrics",
            "the o_proj metrics value feedback needs (collect_statistics records them)",
            None,
        )
    rope_pairs = config.resolved_rope_pairs
    if config.rope_pairs is None and stats.prerope_mean is None:
        rope_pairs = 0  # the default on statistics without pre-RoPE means (no static RoPE): off
    rope = rope_pairs != 0
    if rope:
        check(
            stats.prerope_mean is not None and stats.rope_inv_freq is not None,
            "statistics.prerope_mean",
            "the pre-RoPE key means rope_pairs needs (collect_statistics(rope_inv_freq=...))",
            None,
        )
        check(
            all(smp.positions is not None for smp in stats.samples),
            "statistics.samples.positions",
            "the sampled rows' positions rope_pairs needs",
            None,
        )
        out["k_rope_mean"] = []
    selected: list[list[int]] = []
    clip_report: dict[str, list[float]] = {"k_error_ratio": [], "v_error_ratio": []}
    for i in range(info.num_layers):
        c_q = stats.query_cov[i].result(config.granularity).cpu()  # [G, d, d]
        c_s = stats.value_cov[i].result(config.granularity).cpu()
        R_k, lam_k = _rotation(c_q, gs, config)
        R_v, lam_v = _rotation(c_s, gs, config)
        mean = stats.key_mean[i].result(config.granularity).cpu()  # [G, d]
        sample = stats.samples[i]
        raw_keys = sample.keys.double()  # [N, H_kv, d]
        if rope:
            # the served centering: k − RoPE_p(m) on the selected pairs, then the static mean of
            # what is left (the post-RoPE mean of the residual keys, exact from the phase means)
            # the float32 frequencies the artifact stores and every reader serves with
            inv_freq = stats.rope_inv_freq.float().double()
            m = stats.prerope_mean[i].result(config.granularity).cpu().double()  # [G, d]
            pairs = select_rope_pairs(
                m,
                torch.diagonal(c_q.double(), dim1=-2, dim2=-1),
                inv_freq,
                stats.positions_per_chunk,
                rope_pairs,
            )
            half = info.head_dim // 2
            keep = torch.zeros(half, dtype=torch.bool)
            keep[pairs] = True
            m_sel = m * torch.cat((keep, keep)).double()
            mean = mean.double() - _rope_residual_mean(m_sel, inv_freq, stats.positions_per_chunk)
            m_heads = m_sel.expand(info.num_kv_heads, -1) if g == 1 else m_sel
            raw_keys = raw_keys - rope_position_mean(m_heads, sample.positions, inv_freq).double()
            out["k_rope_mean"].append(m_sel)
            selected.append(pairs.tolist())
        keys = _grouped(raw_keys, g)  # [N, G, d]
        values = _grouped(sample.values.double(), g)
        weights = _grouped(sample.key_weights.double(), g)  # [N, G]
        if config.key_centering:
            keys = keys - mean.to(keys)
        x_k = torch.einsum("ngi,gij->ngj", keys, R_k).float()
        x_v = torch.einsum("ngi,gij->ngj", values, R_v).float()
        if config.clip and x_k.shape[0] > 0:
            metric = (R_k.transpose(-1, -2) @ c_q @ R_k).float()
            k_weights = weights.float() if config.key_clip_objective == "attention" else None
            k_search = search_clip_ratio(x_k, gs, metric=metric, weights=k_weights)
            v_search = search_clip_ratio(x_v, gs, weights=weights.float())
            # Tempered: the searched ratio minimises per-row error on sampled rows, which is not
            # the end-to-end optimum (docs/results.md); alpha ** clip_power is stored, so engines
            # serve what eval measured.
            p = float(config.clip_power)
            pv = p if config.value_clip_power is None else float(config.value_clip_power)
            k_clip, v_clip = k_search.ratios**p, v_search.ratios**pv
            # report the error of what is stored (the tempered ratios), not of the raw search result
            k_err = clip_error(x_k, gs, k_clip, metric=metric, weights=k_weights)
            v_err = clip_error(x_v, gs, v_clip, weights=weights.float())
            clip_report["k_error_ratio"].append(float((k_err / k_search.error_unclipped).mean()))
            clip_report["v_error_ratio"].append(float((v_err / v_search.error_unclipped).mean()))
        else:
            k_clip = v_clip = torch.ones(g)
        out["k_rotation"].append(R_k)
        out["v_rotation"].append(R_v)
        out["k_eigenvalues"].append(lam_k)
        out["v_eigenvalues"].append(lam_v)
        out["k_clip"].append(k_clip)
        out["v_clip"].append(v_clip)
        out["k_mean"].append(mean)
        if "k" in config.feedback:
            m_k = R_k.transpose(-1, -2) @ c_q.double() @ R_k
            out["k_feedback"].append(feedback_matrix(m_k, config.feedback_damp))
        if "v" in config.feedback:
            m_v = _group_metric(stats.output_metrics[i], info.num_kv_heads, g)
            out["v_feedback"].append(feedback_matrix(R_v.transpose(-1, -2) @ m_v @ R_v, config.feedback_damp))
    meta = dict(calibration or {})
    if config.feedback != "none":
        meta["feedback"] = {"rows": config.feedback, "damp": float(config.feedback_damp)}
    meta["clip_power"] = float(config.clip_power) if config.clip else 1.0
    if config.clip and config.value_clip_power is not None:
        meta["value_clip_power"] = float(config.value_clip_power)
    if clip_report["k_error_ratio"]:
        # clipped / unclipped attention-aware error on the calibration rows, mean over layers
        meta["clip_error_ratio"] = {
            "k": round(sum(clip_report["k_error_ratio"]) / info.num_layers, 4),
            "v": round(sum(clip_report["v_error_ratio"]) / info.num_layers, 4),
        }
    k_mean = out.pop("k_mean") if config.key_centering else None
    out.pop("k_mean", None)
    k_feedback, v_feedback = out.pop("k_feedback") or None, out.pop("v_feedback") or None
    k_rope_mean = out.pop("k_rope_mean", None)
    if rope:
        meta["rope_mean"] = {
            "rope_pairs": rope_pairs,
            "rule": "all pairs" if rope_pairs == "all" else _ROPE_RULE,
            "positions": list(stats.positions_per_chunk),
            "pairs_per_layer": selected if rope_pairs != "all" else None,
        }
    return Rotations(
        model=model,
        num_layers=info.num_layers,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        group_size=gs,
        sink_tokens=config.sink,
        recent_tokens=config.recent,
        granularity=config.granularity,
        k_mean=k_mean,
        k_feedback=k_feedback,
        v_feedback=v_feedback,
        k_rope_mean=k_rope_mean,
        rope_inv_freq=stats.rope_inv_freq.float() if rope else None,
        calibration=meta,
        **out,
    )


def calibrate(
    model: Any,
    tokenizer: Any,
    config: CalibrationConfig | None = None,
    *,
    model_name: str | None = None,
    progress: bool = True,
) -> Rotations:
    """Calibrate OSCAR rotations, key means and clip ratios for ``model``.

    Args:
        model: a loaded causal LM (llama, mistral, qwen2, qwen3 families).
        tokenizer: its tokenizer.
        config: :class:`CalibrationConfig` (defaults: 8192 tokens of the built-in text).
        model_name: identifier stored in the artifact (default: ``config.name_or_path``
            of the model, or its ``model_type``).
        progress: tqdm bar with tokens/s on stderr.

    Returns:
        :class:`oscar_math.artifact.Rotations` (save with ``oscar_math.save_rotations``).
    """
    config = CalibrationConfig() if config is None else config
    info = model_info(model)
    config.resolved_group_size(info.head_dim)  # fail before the expensive pass
    # past the trained context RoPE positions measure a broken model, not the quantisation
    check(
        not info.max_positions or config.seq_len <= info.max_positions,
        "seq_len",
        f"at most the model's context ({info.max_positions} positions)",
        config.seq_len,
    )
    inv_freq = None
    if config.resolved_rope_pairs != 0:
        import sys

        from oscar_math.errors import OscarError

        from .rope_mean import rope_inv_freq

        try:
            inv_freq = rope_inv_freq(model)  # refuses scaled RoPE variants before the expensive pass
        except OscarError as e:
            if config.rope_pairs is not None:  # asked for explicitly: refuse
                raise
            print(f"calibrate: no pre-RoPE key mean (format version 1/2): {e}", file=sys.stderr)
    chunks, source = calibration_chunks(tokenizer, config)
    stats = collect_statistics(
        model,
        chunks,
        sink=config.sink,
        max_samples=config.max_samples,
        seed=config.seed,
        progress=progress,
        rope_inv_freq=inv_freq,
    )
    calibration = {
        "tokens": stats.tokens,
        "chunks": len(chunks),
        "seq_len": config.seq_len,
        "text": source,
        "text_part": f"calibration split (held-out fraction {config.heldout_fraction})",
        "seed": config.seed,
        "tool": "oscar-calib",
        "tool_version": tool_version(),
        "config": json.loads(json.dumps(asdict(config))),
        "samples_per_layer": int(stats.samples[0].keys.shape[0]),
    }
    name = model_name or getattr(model.config, "name_or_path", None) or info.model_type
    kl_search = config.clip and config.clip_search == "kl"
    # the KL search starts from the searched ratios (powers 1) and chooses the powers itself
    derive = replace(config, clip_power=1.0, value_clip_power=1.0) if kl_search else config
    with _single_thread():  # small ops: threads cost more than they gain
        rotations = rotations_from_statistics(
            stats, derive, model=Path(str(name)).name or str(name), calibration=calibration
        )
    if config.clip and config.clip_search == "output":
        rotations = refine_clip_by_output(model, tokenizer, rotations, config, progress=progress)
    if kl_search:
        rotations = refine_clip_powers_by_kl(model, tokenizer, rotations, config, progress=progress)
    return rotations


def refine_clip_powers_by_kl(
    model: Any, tokenizer: Any, searched: Rotations, config: CalibrationConfig, *, progress: bool = False
) -> Rotations:
    """Per-block clip powers chosen by end-to-end KL on the search sequences
    (:func:`oscar_calib.power_search.search_clip_powers`); ``searched`` holds powers-1 ratios.

    The metadata records the powers per layer, the search's sequences and its objective.
    """
    import time

    from .power_search import apply_clip_powers, search_clip_powers
    from .simulate import Windows

    start = time.perf_counter()
    info = model_info(model)
    chunks = search_chunks(tokenizer, config, info.max_positions)
    pv = config.clip_power if config.value_clip_power is None else config.value_clip_power
    found = search_clip_powers(
        model,
        searched,
        chunks,
        windows=Windows(config.sink, config.recent),
        blocks=min(config.power_blocks, info.num_layers),
        start=(float(config.clip_power), float(pv)),
        progress=progress,
    )
    rotations = apply_clip_powers(searched, found.k_power, found.v_power)
    meta = dict(rotations.calibration)
    meta["clip_search"] = {
        "objective": "mean KL(bf16 || oscar2) through the emulated serving cache",
        "sequences": len(chunks),
        "tokens_per_sequence": int(chunks[0].numel()),
        "blocks": min(config.power_blocks, info.num_layers),
        "start_power": {"k": float(config.clip_power), "v": float(pv)},
        "kl_start": round(found.kl_start, 6),
        "kl_chosen": round(found.kl_chosen, 6),
        "evaluations": found.evaluations,
        "seconds": round(time.perf_counter() - start, 1),
    }
    return replace(rotations, calibration=meta)


def search_chunks(tokenizer: Any, config: CalibrationConfig, max_positions: int = 0) -> list[torch.Tensor]:
    """The output search's sequences: ``search_seqs`` windows of ``search_context`` tokens of
    the calibration part (seed ``seed + 1``, so not the row-search chunks' choice), shortened to
    ``max_positions`` if the model's context is shorter."""
    text = load_text(config.text)
    calibration_text, _ = split_text(text, config.heldout_fraction)
    ctx = config.search_context if max_positions <= 0 else min(config.search_context, max_positions)
    return token_chunks(tokenizer, calibration_text, ctx, ctx * config.search_seqs, config.seed + 1)


def refine_clip_by_output(
    model: Any,
    tokenizer: Any,
    rotations: Rotations,
    config: CalibrationConfig,
    *,
    progress: bool = False,
    search_keys: bool = True,
    search_values: bool = True,
) -> Rotations:
    """Replace ``rotations``' clip ratios by the output search's (:mod:`oscar_calib.output_clip`).

    Rotations, key mean, windows and format stay as they are; the metadata records the
    search and its objective (``output_error_ratio``: chosen / start, summed over layers).
    """
    import dataclasses
    import sys
    import time

    from .output_clip import capture_layers, output_metrics, search_output_clip

    info = model_info(model)
    start = time.perf_counter()
    chunks = search_chunks(tokenizer, config, info.max_positions)
    captures = capture_layers(
        model,
        chunks,
        first_row=config.sink + config.recent,
        row_stride=config.search_row_stride,
        gradients=config.search_weighting == "fisher",
    )
    metrics = output_metrics(model, info.num_q_heads, info.head_dim)
    if progress:
        print(f"output clip search on {len(chunks)} x {chunks[0].numel()} tokens", file=sys.stderr)
    with _single_thread():
        found = search_output_clip(
            captures,
            metrics,
            rotations,
            sink=config.sink,
            recent=config.recent,
            search_keys=search_keys,
            search_values=search_values,
        )
    meta = dict(rotations.calibration)
    # the stored ratios are no longer searched ** power: schemes must not undo a power
    meta.pop("clip_power", None)
    meta.pop("value_clip_power", None)
    meta.pop("clip_error_ratio", None)  # the row search's error of ratios no longer stored
    meta["row_clip_power"] = {
        "k": float(config.clip_power),
        "v": float(config.clip_power if config.value_clip_power is None else config.value_clip_power),
    }
    meta["clip_search"] = {
        "objective": f"attention output error ({config.search_weighting} weighting), serving windows",
        "sequences": len(chunks),
        "tokens_per_sequence": int(chunks[0].numel()),
        "row_stride": config.search_row_stride,
        "keys": search_keys,
        "values": search_values,
        "seconds": round(time.perf_counter() - start, 1),
    }
    meta["output_error_ratio"] = {
        "chosen_vs_row_search": round(sum(found.error_chosen) / max(sum(found.error_start), 1e-30), 4),
        "chosen_vs_unclipped": round(sum(found.error_chosen) / max(sum(found.error_unclipped), 1e-30), 4),
    }
    return dataclasses.replace(
        rotations,
        k_clip=tuple(c.to(rotations.k_clip[0].dtype) for c in found.k_clip),
        v_clip=tuple(c.to(rotations.v_clip[0].dtype) for c in found.v_clip),
        calibration=meta,
    )
