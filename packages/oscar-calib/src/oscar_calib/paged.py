"""A small serving loop: a transformers causal LM whose attention runs on the paged INT2 cache.

Every decoder layer's attention goes through ``oscar_kernels`` (the optional extra
``oscar-calib[kernels]``): the new tokens' keys/values are written by ``paged_write``
(rotate, clip, quantise, pack into INT2 pages, plus the BF16 sink/recent windows), a
prefill chunk attends with ``extend_attention`` and a decode step with
``decode_attention``. The ops dispatch by device: Triton kernels for CUDA tensors, the
torch references on CPU, so the same loop is what CPU CI tests and what runs on a GPU.

Several sequences of different lengths share one forward pass: their new tokens are
packed into one ``[1, T]`` row with per-token ``position_ids`` (RoPE restarts per
sequence), and the attention override cuts the row back into sequences with
``cu_seqlens``/``seq_lens``, the way vLLM and SGLang call the same kernels. Pages come
from one shared pool (a free list); each live sequence owns one row of the window
pools. The windows slide by themselves (see ``docs/kernels.md``): nothing moves when a
token leaves the recent window.

Semantics: per query token, in prefill chunks and decode alike — query ``t`` reads key
``j`` quantised iff ``sink <= j <= t - recent`` (the rule of ``oscar eval``'s ``oscar2``
emulation, :mod:`oscar_calib.simulate` with ``prefill_chunk=1``). So the outputs do not
depend on the prefill chunk size or on which sequences share a step. A prefill step
writes the chunk's INT2 rows and sink rows, attends, then writes its ring rows
(``paged_write(parts=...)``); a decode step writes everything, then attends.

    lm = PagedLM(model, rotations, PagedConfig(max_seqs=4, max_len=4096))
    out = lm.generate([ids_a, ids_b], max_new_tokens=32)          # greedy, batched
    hidden = lm.final_hidden([ids_a, ids_b], chunk=256)           # for perplexity

``kv="bf16"`` runs the same loop over plain BF16 pages (the baseline of the
tokens/s comparison: ``paged_bf16_decode`` on CUDA, torch attention elsewhere).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from oscar_math import OscarError, check
from oscar_math.hookspecs import SchemeSpec, hookimpl

from .schemes import KVScheme, SchemeContext, build_scheme

__all__ = [
    "KV_KINDS",
    "PagedConfig",
    "PagedLM",
    "GenerationResult",
    "PagedScheme",
    "kernels_available",
    "make_kernels_scheme",
]

#: cache contents the loop can serve: the OSCAR INT2 cache or plain BF16 pages (baseline)
KV_KINDS = ("int2", "bf16")

_KERNELS_EXTRA = "pip install 'oscar-calib[kernels]'"


def kernels_available() -> bool:
    """Whether ``oscar_kernels`` can be imported."""
    import importlib.util

    return importlib.util.find_spec("oscar_kernels") is not None


def _kernels() -> Any:
    try:
        import oscar_kernels
    except ImportError as exc:
        raise OscarError(
            f"the paged serving loop needs oscar-kernels; install it with: {_KERNELS_EXTRA}"
        ) from exc
    return oscar_kernels


@dataclass(frozen=True)
class PagedConfig:
    """Sizes of the serving loop.

    Attributes:
        max_seqs: concurrent sequences (rows of the window pools).
        max_len: longest sequence (prompt + generated) in tokens; sizes the page pool
            (``max_seqs * ceil(max_len / page_size)`` pages) and the block table width.
        page_size: tokens per INT2 page.
        sink, recent: BF16 windows (tokens); ``None``: the artifact's (what the engines serve).
        group_size: INT2 group (None: the artifact's, else the head dim).
        prefill_chunk: tokens per sequence per prefill step.
        kv: ``int2`` (the OSCAR cache) or ``bf16`` (plain BF16 pages, the baseline).
        backend: ``auto`` (Triton on CUDA, torch references elsewhere), ``triton`` or ``torch``.
    """

    max_seqs: int = 8
    max_len: int = 8192
    page_size: int = 64
    sink: int | None = None
    recent: int | None = None
    group_size: int | None = None
    prefill_chunk: int = 256
    kv: str = "int2"
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_len", "page_size", "prefill_chunk"):
            v = getattr(self, name)
            check(isinstance(v, int) and v >= 1, name, "an integer >= 1", v)
        sink_ok = self.sink is None or (isinstance(self.sink, int) and self.sink >= 0)
        check(sink_ok, "sink", "None or an integer >= 0", self.sink)
        recent_ok = self.recent is None or (isinstance(self.recent, int) and self.recent >= 1)
        check(recent_ok, "recent", "None or an integer >= 1", self.recent)
        check(self.kv in KV_KINDS, "kv", f"one of {KV_KINDS}", repr(self.kv))
        check(
            self.backend in ("auto", "triton", "torch"),
            "backend",
            "auto, triton or torch",
            repr(self.backend),
        )

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_len // self.page_size)


@dataclass
class _Seq:
    slot: int
    pages: list[int] = field(default_factory=list)
    length: int = 0


@dataclass
class _Step:
    """Per-step operands shared by every layer (device tensors, built once per forward)."""

    slot_mapping: torch.Tensor
    positions: torch.Tensor
    seq_index: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    block_table: torch.Tensor
    window_slots: torch.Tensor
    max_query_len: int
    decode: bool
    host_prefix: list[int]
    host_lens: list[int]


@dataclass
class GenerationResult:
    """Output of :meth:`PagedLM.generate`.

    Attributes:
        tokens: generated ids per sequence (prompt excluded).
        prefill_seconds, decode_seconds: wall time of the two phases (synchronised).
        decode_tokens: tokens produced by decode steps (all sequences).
    """

    tokens: list[list[int]]
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")


def _geometry(model: Any) -> tuple[int, int, int, int]:
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (
        int(cfg.num_hidden_layers),
        int(cfg.num_attention_heads),
        int(cfg.num_key_value_heads),
        int(head_dim),
    )


class PagedLM:
    """Serve ``model`` with the paged OSCAR cache (or plain BF16 pages with ``kv="bf16"``).

    Args:
        model: a transformers causal LM (llama / mistral / qwen2 / qwen3 families).
        rotations: a loaded :class:`oscar_math.artifact.Rotations` (needed for ``kv="int2"``).
        config: :class:`PagedConfig`.
    """

    def __init__(self, model: Any, rotations: Any, config: PagedConfig | None = None):
        ok = _kernels()
        self.model, self.config = model, config or PagedConfig()
        cfg = self.config
        self.num_layers, self.num_q_heads, self.num_kv_heads, self.head_dim = _geometry(model)
        self.device = next(model.parameters()).device
        if cfg.kv == "int2":
            check(rotations is not None, "rotations", "a calibrated artifact for kv='int2'", None)
            check(
                (rotations.num_layers, rotations.num_kv_heads, rotations.head_dim)
                == (self.num_layers, self.num_kv_heads, self.head_dim),
                "rotations geometry (layers, kv heads, head dim)",
                (self.num_layers, self.num_kv_heads, self.head_dim),
                (rotations.num_layers, rotations.num_kv_heads, rotations.head_dim),
            )
            # the serving layout (the artifact's group and windows), then this loop's overrides
            chosen = (
                ("group_size", cfg.group_size),
                ("sink_tokens", cfg.sink),
                ("recent_tokens", cfg.recent),
            )
            from oscar_kernels.serving import rank_layout  # present: _kernels() imported the package

            self.layout = replace(
                rank_layout(rotations, self.num_kv_heads, self.head_dim, cfg.page_size),
                **{name: v for name, v in chosen if v is not None},
            )
        num_pages = cfg.max_seqs * cfg.pages_per_seq
        self.caches: list[Any] = []
        self.params: list[Any] = []
        for i in range(self.num_layers):
            if cfg.kv == "int2":
                self.caches.append(ok.allocate_cache(self.layout, num_pages, cfg.max_seqs, self.device))
                lp = ok.LayerQuantParams.from_rotations(rotations, i)
                self.params.append(lp.expand(self.num_kv_heads, self.head_dim, self.device))
            else:
                shape = (num_pages, self.num_kv_heads, cfg.page_size, self.head_dim)
                self.caches.append(
                    (
                        torch.zeros(shape, dtype=torch.bfloat16, device=self.device),
                        torch.zeros(shape, dtype=torch.bfloat16, device=self.device),
                    )
                )
        self._free_pages = list(range(num_pages - 1, -1, -1))
        self._free_slots = list(range(cfg.max_seqs - 1, -1, -1))
        self._seqs: dict[int, _Seq] = {}
        self._next_id = 0
        self._step: _Step | None = None

    # ---------------------------------------------------------------- sequences and pages

    def add_sequence(self) -> int:
        """Open a sequence (takes a window slot); returns its id."""
        if not self._free_slots:
            raise OscarError(
                f"Invalid batch: expected at most max_seqs={self.config.max_seqs} live sequences"
            )
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Seq(self._free_slots.pop())
        return sid

    def free_sequence(self, sid: int) -> None:
        """Close a sequence: its pages and window slot go back to the pools."""
        seq = self._seqs.pop(sid)
        self._free_pages.extend(reversed(seq.pages))
        self._free_slots.append(seq.slot)

    def seq_len(self, sid: int) -> int:
        return self._seqs[sid].length

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def _reserve(self, seq: _Seq, new_len: int) -> None:
        check(new_len <= self.config.max_len, "sequence length", f"<= max_len {self.config.max_len}", new_len)
        need = -(-new_len // self.config.page_size) - len(seq.pages)
        if need > len(self._free_pages):
            raise OscarError(
                f"Invalid batch: expected at most {len(self._free_pages)} free pages, got {need} needed"
            )
        for _ in range(need):
            seq.pages.append(self._free_pages.pop())

    def _build_step(self, sids: Sequence[int], counts: Sequence[int]) -> tuple[_Step, list[int]]:
        ps = self.config.page_size
        slot_mapping, positions, seq_index, prefix, lens, cu = [], [], [], [], [], [0]
        table = []
        for b, (sid, n) in enumerate(zip(sids, counts, strict=True)):
            seq = self._seqs[sid]
            p0 = seq.length
            self._reserve(seq, p0 + n)
            pos = list(range(p0, p0 + n))
            positions += pos
            slot_mapping += [seq.pages[p // ps] * ps + p % ps for p in pos]
            seq_index += [b] * n
            prefix.append(p0)
            lens.append(p0 + n)
            cu.append(cu[-1] + n)
            table.append(seq.pages + [0] * (self.config.pages_per_seq - len(seq.pages)))

        def dev(x: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32).to(self.device, non_blocking=True)

        step = _Step(
            slot_mapping=dev(slot_mapping),
            positions=dev(positions),
            seq_index=dev(seq_index),
            seq_lens=dev(lens),
            prefix_lens=dev(prefix),
            cu_seqlens=dev(cu),
            block_table=dev(table),
            window_slots=dev([self._seqs[s].slot for s in sids]),
            max_query_len=max(counts),
            decode=all(n == 1 for n in counts),
            host_prefix=prefix,
            host_lens=lens,
        )
        return step, positions

    # ---------------------------------------------------------------- the forward pass

    @torch.no_grad()
    def forward(self, sids: Sequence[int], tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Append ``tokens[b]`` (1-D ids) to sequence ``sids[b]`` in one packed forward pass.

        Returns the final (normed) hidden states ``[n_b, hidden]`` of each sequence's new tokens.
        """
        check(
            len(sids) == len(tokens) and len(sids) >= 1, "batch", "one token tensor per sequence", len(tokens)
        )
        check(len(set(sids)) == len(sids), "batch", "distinct sequences", list(sids))
        counts = [int(t.numel()) for t in tokens]
        check(min(counts) >= 1, "tokens", "at least one new token per sequence", counts)
        step, positions = self._build_step(sids, counts)
        ids = torch.cat([t.reshape(-1).to(torch.long) for t in tokens]).to(self.device)[None]
        pos = torch.tensor(positions, dtype=torch.long).to(self.device)[None]
        from .attention import attention_override

        self._step = step
        try:
            with attention_override(self.model, self._attend):
                hidden = self.model.get_decoder()(input_ids=ids, position_ids=pos, use_cache=False)
        finally:
            self._step = None
        for sid, n in zip(sids, counts, strict=True):
            self._seqs[sid].length += n
        return list(hidden.last_hidden_state[0].split(counts))

    def _attend(
        self,
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        scaling: float,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The attention override: ``[1, H, T, d]`` packed q/k/v → ``[1, T, H_q, d]`` (mask unused:
        causality and sequence boundaries come from the step's ``cu_seqlens``/``seq_lens``)."""
        st, i = self._step, int(ctx.layer_idx)
        assert st is not None  # set by forward()
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        if self.config.kv == "bf16":
            return self._attend_bf16(i, q, k, v, scaling)[None]
        ok = _kernels()
        cache, ep, be = self.caches[i], self.params[i], self.config.backend
        wargs = (st.slot_mapping, st.positions, st.seq_index, st.seq_lens, st.window_slots)
        if st.decode:  # one new token per sequence: write it all, then decode reads it from the ring
            ok.paged_write(cache, ep, k, v, *wargs, backend=be)
            out = ok.decode_attention(
                q, cache, ep, st.block_table, st.seq_lens, st.window_slots, softmax_scale=scaling, backend=be
            )
        else:
            # INT2 rows + sink before (a chunk longer than recent reads its own older keys as
            # INT2), ring rows after (they overwrite rows the chunk's first queries read)
            ok.paged_write(cache, ep, k, v, *wargs, backend=be, parts="pages")
            out = ok.extend_attention(
                q,
                k,
                v,
                cache,
                ep,
                st.cu_seqlens,
                st.prefix_lens,
                st.block_table,
                st.window_slots,
                st.max_query_len,
                softmax_scale=scaling,
                backend=be,
            )
            ok.paged_write(cache, ep, k, v, *wargs, backend=be, parts="ring")
        return out[None]

    def _attend_bf16(
        self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """Baseline: write to BF16 pages, attend over the whole cached sequence in BF16."""
        st, ps = self._step, self.config.page_size
        kp, vp = self.caches[i]
        slots = st.slot_mapping.long()
        kp[slots // ps, :, slots % ps] = k.to(kp.dtype)
        vp[slots // ps, :, slots % ps] = v.to(vp.dtype)
        if st.decode and q.is_cuda and self.config.backend != "torch":
            ok = _kernels()
            out = ok.paged_bf16_decode(
                q.to(torch.bfloat16), kp, vp, st.block_table, st.seq_lens, softmax_scale=scaling
            )
            return out.to(q.dtype)
        from .simulate import exact_attention

        outs = []
        for b in range(len(st.host_lens)):  # torch path: one sequence at a time
            a, e, n = int(st.cu_seqlens[b]), int(st.cu_seqlens[b + 1]), st.host_lens[b]
            pages = st.block_table[b, : -(-n // ps)].long()
            kk = kp[pages].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :n]
            vv = vp[pages].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :n]
            qb = q[a:e].transpose(0, 1)[None]
            outs.append(exact_attention(qb, kk[None].to(q.dtype), vv[None].to(q.dtype), scaling)[0])
        return torch.cat(outs, 0)

    # ---------------------------------------------------------------- user-level loops

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prefill(
        self, sids: Sequence[int], prompts: Sequence[torch.Tensor], chunk: int | None = None
    ) -> list[torch.Tensor]:
        """Feed each prompt in chunks of ``chunk`` tokens (all sequences advance together; a
        finished one drops out of later steps). Returns every prompt token's final hidden state."""
        chunk = chunk or self.config.prefill_chunk
        check(chunk >= 1, "chunk", ">= 1", chunk)
        done = [0] * len(prompts)
        parts: list[list[torch.Tensor]] = [[] for _ in prompts]
        while True:
            live = [b for b, p in enumerate(prompts) if done[b] < p.numel()]
            if not live:
                break
            pieces = [prompts[b][done[b] : done[b] + chunk] for b in live]
            outs = self.forward([sids[b] for b in live], pieces)
            for b, piece, out in zip(live, pieces, outs, strict=True):
                parts[b].append(out)
                done[b] += piece.numel()
        return [torch.cat(p, 0) for p in parts]

    def final_hidden(self, sequences: Sequence[torch.Tensor], chunk: int | None = None) -> list[torch.Tensor]:
        """Final hidden states ``[T_b, hidden]`` of whole sequences served through the cache
        (teacher forcing, prefill in chunks): what perplexity is computed from."""
        sids = [self.add_sequence() for _ in sequences]
        try:
            return self.prefill(sids, [s.reshape(-1) for s in sequences], chunk)
        finally:
            for sid in sids:
                self.free_sequence(sid)

    @contextlib.contextmanager
    def _sequences(self, n: int) -> Iterator[list[int]]:
        sids = [self.add_sequence() for _ in range(n)]
        try:
            yield sids
        finally:
            for sid in sids:
                self.free_sequence(sid)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int,
        chunk: int | None = None,
        eos_token_id: int | None = None,
        forced: Sequence[Sequence[int]] | None = None,
    ) -> GenerationResult:
        """Greedy generation for a batch of prompts of any lengths.

        Prefill in chunks, then one decode step per new token for every unfinished
        sequence (a sequence stops at ``eos_token_id`` or ``max_new_tokens``).
        ``forced`` (teacher forcing): feed these tokens instead of the argmax; the result
        still holds the argmax predicted at every step (to compare with another
        implementation position by position, without one near-tie derailing the rest).
        """
        check(max_new_tokens >= 1, "max_new_tokens", ">= 1", max_new_tokens)
        if forced is not None:
            check(
                len(forced) == len(prompts) and all(len(f) >= max_new_tokens for f in forced),
                "forced",
                f"{len(prompts)} token lists of >= {max_new_tokens} tokens",
                [len(f) for f in forced],
            )
            eos_token_id = None
        fed: list[list[int]] = [[] for _ in prompts]
        check(all(p.numel() >= 1 for p in prompts), "prompts", "non-empty", [p.numel() for p in prompts])
        head = self.model.get_output_embeddings()
        with self._sequences(len(prompts)) as sids:
            self._sync()
            t0 = time.perf_counter()
            hidden = self.prefill(sids, [p.reshape(-1) for p in prompts], chunk)
            last = torch.stack([h[-1] for h in hidden])
            out: list[list[int]] = [[] for _ in prompts]
            nxt = head(last).argmax(-1)
            self._sync()
            t1 = time.perf_counter()
            live = list(range(len(prompts)))
            decoded = 0
            for b, tok in enumerate(nxt.tolist()):
                out[b].append(tok)
                fed[b].append(tok if forced is None else int(forced[b][0]))
            while True:
                live = [
                    b
                    for b in live
                    if len(out[b]) < max_new_tokens and (eos_token_id is None or fed[b][-1] != eos_token_id)
                ]
                if not live:
                    break
                toks = [torch.tensor([fed[b][-1]]) for b in live]
                hs = self.forward([sids[b] for b in live], toks)
                nxt = head(torch.stack([h[-1] for h in hs])).argmax(-1).tolist()
                decoded += len(live)
                for b, tok in zip(live, nxt, strict=True):
                    out[b].append(tok)
                    fed[b].append(tok if forced is None else int(forced[b][len(fed[b])]))
            self._sync()
            t2 = time.perf_counter()
        return GenerationResult(out, t1 - t0, t2 - t1, decoded)


# -------------------------------------------------------------------- the eval scheme


#: prefill chunk of ``oscar2-kernels`` in ``oscar eval`` (the result does not depend on it)
KERNELS_EVAL_CHUNK = 256


class PagedScheme(KVScheme):
    """``oscar2-kernels``: ``oscar2`` served through :class:`PagedLM` instead of emulated.

    Fake quantisation, codecs and bits delegate to ``oscar2`` (so the passkey test and
    error capture see the same numbers); :func:`oscar_calib.evaluate.run_eval` calls
    :meth:`final_hidden` for perplexity, which runs the real kernels (Triton on CUDA,
    the torch references on CPU). The kernels apply the windows per query token whatever
    the chunk, so the result is comparable with the per-query emulation
    (``prefill_chunk=1``); it prefills in chunks of the evaluation's
    ``Windows.prefill_chunk`` when that is > 1, else of :data:`KERNELS_EVAL_CHUNK` tokens.
    """

    paged = True

    def __init__(self, base: KVScheme, rotations: Any, group_size: int):
        self.base, self.rotations, self.group_size = base, rotations, group_size
        self.name = "oscar2-kernels"
        self.description = "oscar2 served by the paged INT2 kernels (paged_write + extend/decode attention)"

    def fake_quantize_keys(self, layer_idx: int, k: torch.Tensor) -> torch.Tensor:
        return self.base.fake_quantize_keys(layer_idx, k)

    def fake_quantize_values(self, layer_idx: int, v: torch.Tensor) -> torch.Tensor:
        return self.base.fake_quantize_values(layer_idx, v)

    def key_codec(self, layer_idx: int) -> Any:
        return self.base.key_codec(layer_idx)

    def value_codec(self, layer_idx: int) -> Any:
        return self.base.value_codec(layer_idx)

    def bits_per_element(self, seq_len: int, head_dim: int, sink: int, recent: int) -> float:
        return self.base.bits_per_element(seq_len, head_dim, sink, recent)

    def final_hidden(self, model: Any, input_ids: torch.Tensor, windows: Any) -> torch.Tensor:
        """``[T, hidden]`` of one sequence served through the kernels."""
        n = int(input_ids.numel())
        chunk = int(getattr(windows, "prefill_chunk", 1))
        cfg = PagedConfig(
            max_seqs=1,
            max_len=n,
            page_size=64,
            sink=windows.sink,
            recent=windows.recent,
            group_size=self.group_size,
            prefill_chunk=chunk if chunk > 1 else KERNELS_EVAL_CHUNK,
        )
        return PagedLM(model, self.rotations, cfg).final_hidden([input_ids.reshape(-1)])[0]


def make_kernels_scheme(ctx: SchemeContext) -> KVScheme:
    """Factory of the ``oscar2-kernels`` scheme (needs a calibrated artifact and oscar-kernels)."""
    base = build_scheme("oscar2", ctx)
    _kernels()
    return PagedScheme(base, ctx.rotations, ctx.effective_group_size)


@hookimpl
def oscar_schemes() -> list[SchemeSpec]:
    """Hook implementation (entry point ``kernels_scheme``): ``oscar2-kernels``, registered like any
    plugin's scheme, so :mod:`oscar_calib.schemes` never imports this module."""
    return [
        SchemeSpec(
            "oscar2-kernels",
            "oscar2 served by the paged INT2 kernels (Triton on CUDA, torch references on CPU)",
            make_kernels_scheme,
        )
    ]
