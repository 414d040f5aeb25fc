"""Builds SGLang's real pools, allocator, layer, forward batches and backends on CPU for the tests."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import torch

from oscar_math.artifact import identity_rotations, save_rotations

H_Q, H_KV, D, PAGE, SINK, RECENT = 4, 2, 64, 4, 4, 8


def sglang_release() -> str:
    """The supported SGLang release installed (``0.5.17`` / ``0.5.23``), as the plugin picks it."""
    import sglang

    from oscar_sglang.compat import release_of

    return release_of(sglang.__version__) or sglang.__version__


class _Scheduler0523:
    """What SGLang 0.5.23's scheduler does to a request and the tree (``schedule_batch.py``,
    ``mem_cache/common.py``, the test helper ``sglang.test.mem_cache_utils.finish_req``)."""

    @staticmethod
    def alloc_row(pool) -> int:
        return pool.alloc_rows(1)[0]

    @staticmethod
    def free_row(pool, slot: int) -> None:
        """Free a row; the next ``alloc_row`` hands it out again (0.5.23 pops the newest)."""
        pool.free_rows([slot])

    @staticmethod
    def refresh(req) -> None:
        req.refresh_fill_ids()

    @staticmethod
    def admit(tree, req, res) -> torch.Tensor:
        """Adopt a match; returns the prefix's token slots."""
        req.last_node = res.last_device_node
        req.lock = tree.lock(res.last_device_node)
        req.kv.cache_protected_len = int(res.device_prefix_len)
        return tree.path_device_indices(req.last_node)[: int(res.device_prefix_len)]

    @staticmethod
    def allocated(req, total: int) -> None:
        req.kv.kv_allocated_len = total

    @staticmethod
    def extended(tree, req, start: int, end: int, last: bool, use_tree: bool) -> None:
        req.kv.kv_committed_len = end
        req.extend_end = end
        if use_tree:
            tree.checkpoint(req, up_to=end)

    @staticmethod
    def decoded(req, length: int) -> None:
        req.kv.kv_committed_len = length

    @staticmethod
    def finish(tree, req) -> None:
        from sglang.test.mem_cache_utils import finish_req

        finish_req(tree, req, up_to=req.owned_kv_len())


class _Scheduler0517:
    """The same for SGLang 0.5.17: no ``checkpoint``, the tree takes a request's tokens in
    ``cache_unfinished_req`` (after each prefill chunk) and ``cache_finished_req`` (what
    ``release_kv_cache`` calls); the row is ``req.req_pool_idx``; no ``alloc_rows``."""

    @staticmethod
    def alloc_row(pool) -> int:
        return pool.alloc([SimpleNamespace(req_pool_idx=None)])[0]

    @staticmethod
    def free_row(pool, slot: int) -> None:
        """Free a row and put it first: 0.5.17 hands rows out oldest-freed first, so a test that wants
        the row reused at once (with its stale windows) moves it to the front."""
        pool.free(SimpleNamespace(req_pool_idx=slot))
        pool.free_slots.insert(0, pool.free_slots.pop())

    @staticmethod
    def refresh(req) -> None:
        req._refresh_fill_ids()

    @staticmethod
    def admit(tree, req, res) -> torch.Tensor:
        req.last_node = res.last_device_node
        tree.inc_lock_ref(res.last_device_node)
        req.prefix_indices = res.device_indices
        req.cache_protected_len = len(res.device_indices)
        return res.device_indices

    @staticmethod
    def allocated(req, total: int) -> None:
        from sglang.srt.managers.schedule_batch import ReqKvInfo

        req.kv = ReqKvInfo(kv_allocated_len=total, swa_evicted_seqlen=0)

    @staticmethod
    def extended(tree, req, start: int, end: int, last: bool, use_tree: bool) -> None:
        req.kv_committed_len = end
        req.set_extend_range(start, end)
        if use_tree:
            tree.cache_unfinished_req(req, chunked=not last)

    @staticmethod
    def decoded(req, length: int) -> None:
        req.kv_committed_len = length

    @staticmethod
    def finish(tree, req) -> None:
        tree.cache_finished_req(req, kv_len_to_handle=req.kv_committed_len)


def scheduler():
    """The installed release's request/tree steps (``_Scheduler0523`` / ``_Scheduler0517``)."""
    return _Scheduler0517 if sglang_release() == "0.5.17" else _Scheduler0523


def random_orthogonal(g: int, d: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(g, d, d, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()


def make_artifact(
    path, *, layers=1, kv_heads=H_KV, d=D, granularity="kv_head", seed=0, clip=0.95, model="tiny"
):
    gen = torch.Generator().manual_seed(seed)
    rot = identity_rotations(
        model,
        layers,
        kv_heads,
        d,
        sink_tokens=SINK,
        recent_tokens=RECENT,
        granularity=granularity,
        k_clip=clip,
        v_clip=clip,
    )
    g = 1 if granularity == "layer" else kv_heads
    rot = dataclasses.replace(
        rot,
        k_rotation=[random_orthogonal(g, d, gen) for _ in range(layers)],
        v_rotation=[random_orthogonal(g, d, gen) for _ in range(layers)],
        k_mean=[0.1 * torch.randn(g, d, generator=gen) for _ in range(layers)],
    )
    save_rotations(path, rot)
    return rot


class Harness:
    """One layer, ``H_Q`` query / ``H_KV`` KV heads; the OSCAR and SGLang's BF16 pool share one allocator."""

    def __init__(self, artifact, *, num_tokens=256, max_reqs=6, max_context=128, radix="off", snapshots=0):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        from oscar_sglang.core import load_rank_quant
        from oscar_sglang.sglang_glue import OscarAttnBackend, OscarTokenToKVPool

        self.req_pool = ReqToTokenPool(
            size=max_reqs, max_context_len=max_context, device="cpu", enable_memory_saver=False
        )
        quant = load_rank_quant(
            str(artifact), num_layers=1, total_kv_heads=H_KV, head_dim=D, v_head_dim=D, page_size=PAGE
        )
        common = dict(
            page_size=PAGE,
            dtype=torch.bfloat16,
            head_num=H_KV,
            head_dim=D,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        self.pool = OscarTokenToKVPool(
            num_tokens,
            quant=quant,
            max_seqs=self.req_pool.req_to_token.shape[0],
            radix=radix,
            snapshots=snapshots,
            **common,
        )
        self.bf16 = MHATokenToKVPool(num_tokens, **common)
        self.alloc = PagedTokenToKVPoolAllocator(num_tokens, PAGE, torch.bfloat16, "cpu", self.pool, False)
        self.layer = RadixAttention(H_Q, D, 1.0 / math.sqrt(D), H_KV, layer_id=0)
        self.oscar = OscarAttnBackend(
            SimpleNamespace(device="cpu", req_to_token_pool=self.req_pool, token_to_kv_pool=self.pool)
        )
        self.native = TorchNativeAttnBackend(
            SimpleNamespace(device="cpu", req_to_token_pool=self.req_pool, token_to_kv_pool=self.bf16)
        )
        self.quant = quant

    def new_request(self, length: int, share_from: tuple[int, int] | None = None) -> int:
        """A request slot (SGLang's ``alloc_rows``) with page-aligned slots for ``length`` tokens.

        ``share_from=(slot, n)`` maps the first ``n`` positions to another request's slots,
        exactly what a radix-cache hit does (``n`` page-aligned).
        """
        slot = scheduler().alloc_row(self.req_pool)
        n_shared = 0
        if share_from is not None:
            src, n_shared = share_from
            self.req_pool.req_to_token[slot, :n_shared] = self.req_pool.req_to_token[src, :n_shared]
        rest = -(-(length - n_shared) // PAGE) * PAGE
        if rest:
            self.req_pool.req_to_token[slot, n_shared : n_shared + rest] = self.alloc.alloc(rest).to(
                torch.int32
            )
        return slot

    def batch(self, mode: str, slots: list[int], prefix: list[int], new: list[int]):
        """SGLang ``ForwardBatch`` for an extend (``new`` tokens after ``prefix``) or a decode step."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        seq = [p + n for p, n in zip(prefix, new, strict=True)]
        locs = torch.cat(
            [self.req_pool.req_to_token[s, p : p + n] for s, p, n in zip(slots, prefix, new, strict=True)]
        ).long()
        kw = dict(
            batch_size=len(slots),
            input_ids=torch.zeros(sum(new), dtype=torch.int64),
            req_pool_indices=torch.tensor(slots, dtype=torch.int64),
            seq_lens=torch.tensor(seq, dtype=torch.int64),
            seq_lens_cpu=torch.tensor(seq, dtype=torch.int64),
            out_cache_loc=locs,
            seq_lens_sum=sum(seq),
        )
        if mode == "decode":
            return ForwardBatch(forward_mode=ForwardMode.DECODE, **kw)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            extend_num_tokens=sum(new),
            extend_seq_lens=torch.tensor(new, dtype=torch.int32),
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32),
            extend_seq_lens_cpu=list(new),
            extend_prefix_lens_cpu=list(prefix),
            **kw,
        )

    def run(self, backend, fb, q, k, v):
        backend.init_forward_metadata(fb)
        fwd = backend.forward_decode if fb.forward_mode.is_decode() else backend.forward_extend
        # as RadixAttention.forward hands them over: q flat, k/v [N, H_kv, d]
        return fwd(q.reshape(q.shape[0], -1), k, v, self.layer, fb).reshape(q.shape)


def qkv(length: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, H_Q, D, generator=g) * scale
    k = torch.randn(length, H_KV, D, generator=g) * scale + 0.3
    v = torch.randn(length, H_KV, D, generator=g)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def near_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` equals ``b`` up to what float32 sums in another order can do to a bf16 result: each
    element within one unit in the last place of its own magnitude (``rtol`` 2**-7, bf16's largest
    relative spacing), or within 2**-10 of the tensor's largest element where cancellation made
    it small; and few elements differ at all. A wrong row or window moves most elements by more."""
    a, b = a.double(), b.double()
    close = torch.allclose(a, b, rtol=2.0**-7, atol=2.0**-10 * float(b.abs().max()))
    return close and float((a != b).double().mean()) <= 0.02


def token_qkv(tokens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v of each position as a function of the tokens up to it (what a model computes), so
    requests sharing a prefix have the same K/V there, as in a real radix-cache hit."""
    rows = [qkv(1, hash(tuple(tokens[: i + 1])) % (2**31)) for i in range(len(tokens))]
    return tuple(torch.cat([r[j] for r in rows]) for j in range(3))


class TreeFlow:
    """Requests through SGLang's real ``UnifiedRadixCache`` and ``Req`` the way the scheduler drives
    them: ``match_prefix`` -> row + page allocation -> extend chunks, each followed by ``checkpoint``
    (``checkpoint_kv_cache``) -> decode steps -> ``finish_req`` (what ``release_kv_cache`` does)."""

    def __init__(self, h: Harness, tree: str = "unified") -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        self.h = h
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=h.req_pool,
            token_to_kv_pool_allocator=h.alloc,
            page_size=PAGE,
            tree_components=(ComponentType.FULL,),
        )
        # SGLang's default tree, or the older RadixCache (also hooked)
        self.tree = UnifiedRadixCache(params) if tree == "unified" else RadixCache(params)
        self.n = 0
        self.s = scheduler()

    def admit(self, tokens, *, decode=0, use_tree=True):
        """A new request: SGLang's match (through the hooks), a request row, pages for its tokens."""
        from array import array

        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        h, tree = self.h, self.tree
        self.n += 1
        tokens = list(tokens)
        req = Req(
            rid=f"r{self.n}",
            origin_input_text="",
            origin_input_ids=array("q", tokens),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=decode + 1),
        )
        self.s.refresh(req)
        m, path = 0, None
        if use_tree:
            res = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
            path = self.s.admit(tree, req, res)
            m = len(path)
        slot = h.req_pool.alloc([req])[0]
        if m:
            h.req_pool.req_to_token[slot, :m] = path[:m].to(torch.int32)
        total = len(tokens) + decode
        cap = -(-total // PAGE) * PAGE
        h.req_pool.req_to_token[slot, m:cap] = h.alloc.alloc(cap - m).to(torch.int32)
        self.s.allocated(req, total)
        all_tokens = tokens + [1000 + i for i in range(decode + 1)]  # "greedy": same tokens every run
        q, k, v = token_qkv(all_tokens[:total])
        return SimpleNamespace(
            req=req,
            slot=slot,
            m=m,
            n=len(tokens),
            total=total,
            tokens=all_tokens,
            qkv=(q, k, v),
            outs={},
            done=m,
            use_tree=use_tree,
        )

    def extend(self, reqs, upto=None):
        """One extend batch: each request from what it has to ``upto`` (default: its prompt end),
        then SGLang's ``checkpoint`` of each (``checkpoint_kv_cache``)."""
        h = self.h
        ends = [r.n if upto is None else min(upto, r.n) for r in reqs]
        new = [e - r.done for r, e in zip(reqs, ends, strict=True)]
        q, k, v = (
            torch.cat([r.qkv[j][r.done : e] for r, e in zip(reqs, ends, strict=True)]) for j in range(3)
        )
        fb = h.batch("extend", [r.slot for r in reqs], [r.done for r in reqs], new)
        o = h.run(h.oscar, fb, q, k, v)
        at = 0
        for r, e in zip(reqs, ends, strict=True):
            r.outs.update({r.done + i: o[at + i] for i in range(e - r.done)})
            at += e - r.done
            self.s.extended(self.tree, r.req, r.done, e, e == r.n, r.use_tree)
            r.done = e

    def decode(self, reqs):
        """One decode step of every request that has tokens left."""
        h = self.h
        reqs = [r for r in reqs if r.done < r.total]
        pos = [r.done for r in reqs]
        q, k, v = (torch.cat([r.qkv[j][p : p + 1] for r, p in zip(reqs, pos, strict=True)]) for j in range(3))
        o = h.run(h.oscar, h.batch("decode", [r.slot for r in reqs], pos, [1] * len(reqs)), q, k, v)
        for i, (r, p) in enumerate(zip(reqs, pos, strict=True)):
            r.req.output_ids.append(r.tokens[p])
            r.outs[p] = o[i]
            r.done = p + 1
            self.s.decoded(r.req, p + 1)

    def finish(self, r):
        """What ``release_kv_cache`` does for a finished request (``finish_req``), then the row."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        r.req.output_ids.append(r.tokens[r.total])  # the last sampled token has no KV yet
        r.req.finished_reason = FINISH_LENGTH(length=r.total - r.n + 1)
        if r.use_tree:
            self.s.finish(self.tree, r.req)
        self.h.req_pool.free(r.req)

    def run(self, tokens, *, decode=0, chunks=(), use_tree=True, before_forward=None):
        """Prefill ``tokens`` (extend from the radix hit, split at ``chunks``), decode ``decode`` more
        tokens, finish. Returns (outputs of every computed position as ``{pos: out}``, hit length,
        the tokens with KV)."""
        r = self.admit(tokens, decode=decode, use_tree=use_tree)
        if before_forward is not None:
            before_forward()
        for c in [c for c in chunks if r.m < c < r.n] + [r.n]:
            self.extend([r], upto=c)
        while r.done < r.total:
            self.decode([r])
        self.finish(r)
        return r.outs, r.m, r.tokens[: r.total]
