"""The evaluation harness: every scheme, the same sequences and windows, numbers with spreads.

For each context length, ``num_sequences`` held-out windows of that many tokens are
scored by the unquantised model (the reference) and by every scheme under the
serving semantics of :mod:`oscar_calib.simulate`. Per scheme and context it reports
bits per element actually stored, perplexity, the paired perplexity increase over
the reference, mean KL(reference ‖ scheme), top-1 agreement (each as mean ± std
with a bootstrap 95% CI over sequences), the per-layer relative errors of attention
logits and outputs (on the first ``error_sequences`` sequences), and passkey
retrieval accuracy through the real caches (:mod:`oscar_calib.cache`).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from oscar_math import DEFAULT_RECENT, DEFAULT_SINK, check

from .metrics import Summary, final_hidden, sequences_metrics, summarize
from .progress import Step, StepClock
from .schemes import DEFAULT_SCHEMES, KVScheme, SchemeContext, build_scheme, scheme_names
from .simulate import LayerErrors, Windows, simulate

__all__ = ["EvalConfig", "EvalResult", "run_eval", "format_table", "make_cache"]


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate.

    Attributes:
        contexts: sequence lengths in tokens.
        schemes: scheme names (see :func:`oscar_calib.schemes.scheme_names`).
        num_sequences: held-out sequences per context.
        sink, recent: BF16 windows, the same for every scheme.
        group_size: INT2 group size override (None: the artifact's, else ``d``).
        error_sequences: sequences per context on which per-layer errors are captured.
        needle_contexts: passkey prompt lengths (empty: no passkey test).
        needle_depths: relative needle positions.
        needle_trials: prompts per (context, depth).
        needle_schemes: schemes run on the passkey test (None: all).
        seed: seeds sequence choice, passkeys and the Hadamard baseline.
        text: text file (None: the built-in corpus); its held-out part is used.
        prefill_chunk: emulate the chunk-granular rule of an engine that prefills in chunks
            of this many tokens (see :class:`~oscar_calib.simulate.Windows`); 1 = the
            per-query rule, which the kernels apply whatever their chunk. ``oscar2-kernels``
            prefills in chunks of this many tokens when > 1 (else 256).
    """

    contexts: tuple[int, ...] = (1024, 2048)
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    num_sequences: int = 3
    sink: int = DEFAULT_SINK
    recent: int = DEFAULT_RECENT
    group_size: int | None = None
    error_sequences: int = 1
    needle_contexts: tuple[int, ...] = (1024,)
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    needle_trials: int = 1
    needle_schemes: tuple[str, ...] | None = None
    seed: int = 0
    text: str | None = None
    prefill_chunk: int = 1

    def __post_init__(self) -> None:
        for name in ("contexts", "schemes", "needle_contexts", "needle_depths"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.needle_schemes is not None:
            object.__setattr__(self, "needle_schemes", tuple(self.needle_schemes))
        check(len(self.contexts) >= 1, "contexts", "at least one context length", self.contexts)
        for c in (*self.contexts, *self.needle_contexts):
            check(isinstance(c, int) and c >= 16, "context", "an integer >= 16", c)
        check(len(self.schemes) >= 1, "schemes", "at least one scheme", self.schemes)
        check(len(set(self.schemes)) == len(self.schemes), "schemes", "no duplicates", self.schemes)
        check(self.num_sequences >= 1, "num_sequences", "an integer >= 1", self.num_sequences)
        check(self.sink >= 0, "sink", "an integer >= 0", self.sink)
        check(self.recent >= 1, "recent", "an integer >= 1", self.recent)
        check(self.error_sequences >= 0, "error_sequences", "an integer >= 0", self.error_sequences)
        check(self.needle_trials >= 1, "needle_trials", "an integer >= 1", self.needle_trials)
        for d in self.needle_depths:
            check(0.0 <= d <= 1.0, "needle depth", "a value in [0, 1]", d)
        if self.needle_schemes is not None:
            unknown = set(self.needle_schemes) - set(self.schemes)
            check(not unknown, "needle_schemes", "a subset of schemes", sorted(unknown))

    @property
    def windows(self) -> Windows:
        return Windows(self.sink, self.recent, self.prefill_chunk)


@dataclass
class EvalResult:
    """JSON-serialisable result of :func:`run_eval` (see :meth:`to_dict`).

    Attributes:
        model: model name.
        dtype: the model's parameter dtype (the reference is this model with an unquantised cache).
        config: the :class:`EvalConfig` as a dict.
        schemes: ``{name: description}``.
        contexts: ``{context: {scheme: metrics}}`` where metrics holds ``bits_per_element``,
            ``kv_mib`` (the K/V cache of one sequence of that length, MiB), ``perplexity`` /
            ``delta_ppl`` / ``kl`` / ``top1`` summaries (mean, std,
            ci_low, ci_high, n), per-sequence values, and ``logit_error`` / ``output_error``
            per layer (lists) with their means.
        needle: ``{scheme: {"accuracy": float, "correct": int, "total": int, "by_context": {...}}}``.
        timings: seconds per stage.
    """

    model: str
    config: dict[str, Any]
    schemes: dict[str, str]
    dtype: str = "?"
    contexts: dict[str, dict[str, Any]] = field(default_factory=dict)
    needle: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False)


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _geometry(model: Any) -> tuple[int, int, int]:
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return int(head_dim), int(cfg.num_hidden_layers), int(cfg.num_key_value_heads)


def make_cache(scheme: KVScheme, num_layers: int, windows: Windows) -> Any:
    """The cache a scheme is served with: packed :class:`OscarCache` for per-token INT2
    schemes, :class:`SchemeCache` for others (``kivi2``), ``DynamicCache`` for ``bf16``."""
    from transformers import DynamicCache

    from .cache import OscarCache, SchemeCache

    if not scheme.quantized:
        return DynamicCache()
    if scheme.key_codec(0) is not None:
        return OscarCache(scheme, num_layers, windows)
    return SchemeCache(scheme, num_layers, windows)


def _merge(into: dict[int, LayerErrors], errs: dict[int, LayerErrors]) -> None:
    for layer, e in errs.items():
        acc = into.setdefault(layer, LayerErrors())
        acc.logit_err += e.logit_err
        acc.logit_ref += e.logit_ref
        acc.out_err += e.out_err
        acc.out_ref += e.out_ref
        acc.rows += e.rows


def _heldout(config: EvalConfig) -> str:
    from .text import load_text, split_text

    return split_text(load_text(config.text))[1]


def run_eval(
    model: Any,
    tokenizer: Any,
    rotations: Any,
    config: EvalConfig,
    progress: bool = True,
    *,
    model_name: str = "model",
    heldout_text: str | None = None,
) -> EvalResult:
    """Evaluate every scheme of ``config`` on held-out text.

    Args:
        model, tokenizer: a causal LM (float32 on CPU is the tested path) and its tokenizer.
        rotations: :class:`oscar_math.artifact.Rotations` (None: only uncalibrated schemes).
        config: :class:`EvalConfig`.
        progress: print one line per step on stderr (reference pass, each scheme's pass, the
            metrics of each sequence, each passkey scheme) with its time and the time left.
        model_name: stored in the result.
        heldout_text: evaluation text (default: the held-out part of ``config.text``).
    Returns:
        :class:`EvalResult`.
    """
    from .needle import build_needle_cases, run_needle_case
    from .text import token_chunks

    t_start = time.perf_counter()
    head_dim, num_layers, num_kv_heads = _geometry(model)
    ctx = SchemeContext(head_dim, num_layers, num_kv_heads, rotations, config.group_size, config.seed)
    known = scheme_names()
    for name in config.schemes:
        check(name in known, "scheme", f"one of {known}", repr(name))
    schemes = {name: build_scheme(name, ctx) for name in config.schemes}
    text = _heldout(config) if heldout_text is None else heldout_text
    result = EvalResult(
        model=model_name,
        config=asdict(config),
        schemes={n: s.description for n, s in schemes.items()},
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
    )
    windows = config.windows
    seqs_by_context = {
        c: token_chunks(tokenizer, text, c, c * config.num_sequences, config.seed) for c in config.contexts
    }
    needle_names = config.needle_schemes if config.needle_schemes is not None else config.schemes
    cases = (
        build_needle_cases(
            tokenizer, text, config.needle_contexts, config.needle_depths, config.needle_trials, config.seed
        )
        if config.needle_contexts
        else []
    )
    clock = StepClock(_plan(config, schemes, {c: len(v) for c, v in seqs_by_context.items()}, cases))
    device = next(model.parameters()).device

    def step(what: str, t_step: float) -> None:
        """Close the plan's next step (started at ``t_step``) and print it with the time left."""
        took = time.perf_counter() - t_step
        clock.finish(took)
        _log(progress, f"oscar eval: {what}: {took:.1f} s [{clock.status()}]")

    for context in config.contexts:
        t0 = time.perf_counter()
        seqs = seqs_by_context[context]
        if len(seqs) < config.num_sequences:
            _log(progress, f"oscar eval: only {len(seqs)} held-out sequences of {context} tokens available")
        per: dict[str, dict[str, list[float]]] = {n: {"nll": [], "kl": [], "top1": []} for n in schemes}
        errors: dict[str, dict[int, LayerErrors]] = {n: {} for n in schemes}
        for i, seq in enumerate(seqs):
            where = f"context {context}, sequence {i + 1}/{len(seqs)}"
            seq = seq.to(device)
            ids = seq[None]
            ts = t_step = time.perf_counter()
            ref = final_hidden(model, ids)[0]
            step(f"{where}, reference", t_step)
            hiddens = {}
            for name, scheme in schemes.items():
                t_step = time.perf_counter()
                if getattr(scheme, "paged", False):  # served through the real kernels (oscar2-kernels)
                    hiddens[name] = scheme.final_hidden(model, seq, windows)
                elif scheme.quantized:
                    capture = i < config.error_sequences
                    with simulate(model, scheme, windows, capture=capture) as sim:
                        hiddens[name] = final_hidden(model, ids)[0]
                    _merge(errors[name], sim.errors)
                else:
                    hiddens[name] = ref
                    continue
                step(f"{where}, {name}", t_step)
            t_step = time.perf_counter()
            for name, m in sequences_metrics(model, ref, hiddens, seq).items():
                per[name]["nll"].append(m.nll)
                per[name]["kl"].append(m.kl)
                per[name]["top1"].append(m.top1)
            step(f"{where}, metrics", t_step)
            _log(
                progress,
                f"oscar eval: {where}: {len(schemes)} schemes in {time.perf_counter() - ts:.1f} s",
            )
        ref_name = next((n for n, s in schemes.items() if not s.quantized), None)
        block: dict[str, Any] = {}
        for name, scheme in schemes.items():
            ppl = [float(torch.tensor(x).exp()) for x in per[name]["nll"]]
            bits = scheme.bits_per_element(context, head_dim, config.sink, config.recent)
            entry: dict[str, Any] = {
                "bits_per_element": bits,
                # K and V of every layer and KV head for one sequence of this length
                "kv_mib": bits * 2 * num_layers * num_kv_heads * head_dim * context / 8 / 2**20,
                "sequences": len(seqs),
                "perplexity": summarize(ppl, config.seed).to_dict(),
                "kl": summarize(per[name]["kl"], config.seed).to_dict(),
                "top1": summarize(per[name]["top1"], config.seed).to_dict(),
                "per_sequence": {"perplexity": ppl, "kl": per[name]["kl"], "top1": per[name]["top1"]},
            }
            if ref_name is not None:
                ref_ppl = [float(torch.tensor(x).exp()) for x in per[ref_name]["nll"]]
                delta = [p / r - 1.0 for p, r in zip(ppl, ref_ppl, strict=True)]
                entry["delta_ppl"] = summarize(delta, config.seed).to_dict()
            errs = errors[name]
            if errs:
                logit = [errs[i].logit_rel if i in errs else float("nan") for i in range(num_layers)]
                out = [errs[i].output_rel if i in errs else float("nan") for i in range(num_layers)]
                entry["logit_error"] = logit
                entry["output_error"] = out
                entry["logit_error_mean"] = _nanmean(logit)
                entry["output_error_mean"] = _nanmean(out)
            block[name] = entry
        result.contexts[str(context)] = block
        result.timings[f"context_{context}"] = time.perf_counter() - t0
        _log(progress, f"oscar eval: context {context} done in {time.perf_counter() - t0:.1f}s")
    if cases:
        t0 = time.perf_counter()
        for name in needle_names:
            t_step = time.perf_counter()
            scheme = schemes[name]
            correct: dict[str, list[int]] = {}
            answers = []
            for case in cases:
                ok, answer = run_needle_case(
                    model, tokenizer, case, functools.partial(make_cache, scheme, num_layers, windows)
                )
                correct.setdefault(str(case.context), []).append(int(ok))
                answers.append(
                    {"context": case.context, "depth": case.depth, "key": case.key, "answer": answer}
                )
            flat = [c for v in correct.values() for c in v]
            result.needle[name] = {
                "accuracy": sum(flat) / len(flat),
                "correct": sum(flat),
                "total": len(flat),
                "by_context": {c: sum(v) / len(v) for c, v in correct.items()},
                "answers": answers,
            }
            step(f"passkey {name}: {sum(flat)}/{len(flat)}", t_step)
        result.timings["needle"] = time.perf_counter() - t0
    result.timings["total"] = time.perf_counter() - t_start
    return result


def _plan(
    config: EvalConfig, schemes: dict[str, KVScheme], num_seqs: dict[int, int], cases: Sequence[Any]
) -> list[Step]:
    """The steps of :func:`run_eval` in the order it runs them (for the time-left estimate)."""
    plan = []
    for context in config.contexts:
        for i in range(num_seqs[context]):
            plan.append(Step("forward", "reference", context))
            capture = i < config.error_sequences
            plan += [Step("forward", (n, capture), context) for n, s in schemes.items() if s.quantized]
            # the LM head and the log-softmaxes over every scheme's hidden states: until one has
            # been timed, estimated as one forward pass per scheme (SmolLM2 at 2k: 0.7-0.9 of that)
            plan.append(Step("metrics", len(schemes), context * len(schemes), like="forward"))
    if cases:
        size = sum(case.context for case in cases)
        names = config.needle_schemes if config.needle_schemes is not None else config.schemes
        plan += [Step("passkey", name, size, like="forward") for name in names]
    return plan


def _nanmean(xs: Sequence[float]) -> float:
    vals = [x for x in xs if x == x]
    return sum(vals) / len(vals) if vals else float("nan")


def _fmt(s: dict[str, float] | None, digits: int = 3, pct: bool = False) -> str:
    if s is None:
        return "-"
    summ = Summary(**s)
    return summ.fmt(digits, pct)


def _err(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x:.4f}"


def format_table(result: EvalResult | dict[str, Any]) -> str:
    """A readable plain-text table per context (mean ± std over sequences)."""
    r = result.to_dict() if isinstance(result, EvalResult) else result
    cfg = r["config"]
    lines = [
        f"model {r['model']} ({r.get('dtype', '?')}); windows: sink {cfg['sink']}, "
        f"recent {cfg['recent']} tokens kept unquantised"
    ]
    for context, block in r["contexts"].items():
        n = next(iter(block.values()))["sequences"]
        # the per-layer error columns only where some scheme has them (error_sequences > 0)
        layer_errors = any("logit_error_mean" in e for e in block.values())
        header = (
            f"{'scheme':<18}{'bits/el':>8}{'KV MiB':>8}  {'perplexity':>17}  {'Δppl vs bf16':>17}  "
            f"{'KL (nats)':>17}  {'top-1 agree':>17}"
        ) + (f"  {'logit err':>9}  {'out err':>8}" if layer_errors else "")
        lines += ["", f"context {context} tokens, {n} held-out sequences (mean ± std)", header]
        for name, e in block.items():
            mib = e.get("kv_mib")
            lines.append(
                f"{name:<18}{e['bits_per_element']:>8.3f}{'-' if mib is None else f'{mib:.1f}':>8}  "
                f"{_fmt(e['perplexity'], 3):>17}  "
                f"{_fmt(e.get('delta_ppl'), 2, pct=True):>17}  {_fmt(e['kl'], 4):>17}  "
                f"{_fmt(e['top1'], 2, pct=True):>17}"
                + (
                    f"  {_err(e.get('logit_error_mean')):>9}  {_err(e.get('output_error_mean')):>8}"
                    if layer_errors
                    else ""
                )
            )
    if r["needle"]:
        ctxs = ", ".join(str(c) for c in cfg["needle_contexts"])
        lines += ["", f"passkey retrieval (contexts {ctxs}; depths {cfg['needle_depths']})"]
        for name, e in r["needle"].items():
            by = ", ".join(f"{c}: {a:.0%}" for c, a in e["by_context"].items())
            lines.append(f"{name:<18}{e['correct']:>3}/{e['total']:<3} ({by})")
    return "\n".join(lines)
