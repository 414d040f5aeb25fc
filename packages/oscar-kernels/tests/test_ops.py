from dataclasses import replace

import torch
from conftest import DEVICE, fill_cache

from oscar_kernels import CacheLayout, decode_attention, ops
from oscar_kernels.ops import decode_attention_op, register_ops

# on a GPU tl.dot needs d/4 >= 16: head dim 32 compiles only under the interpreter
D = 64 if DEVICE.type == "cuda" else 32


def test_custom_op_matches_and_passes_opcheck():
    gen = torch.Generator().manual_seed(11)
    lo = CacheLayout(2, D, page_size=8, sink_tokens=3, recent_tokens=5)
    lens = [2, 13, 21]
    cache, params, bt, ws, _, _ = fill_cache(lo, lens, gen, "kv_head")
    ep = params.expand(2, D, cache.device)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 4, D, generator=gen).bfloat16().to(DEVICE)
    out = decode_attention_op(q, cache, ep, bt, sl, ws)
    assert torch.equal(out, decode_attention(q, cache, ep, bt, sl, ws))
    # the flag crosses the op (R_V folded into the caller's output projection: rotated outputs)
    kept = replace(ep, rotated_output=True)
    rotated = decode_attention_op(q, cache, kept, bt, sl, ws)
    assert torch.equal(rotated, decode_attention(q, cache, kept, bt, sl, ws)) and not torch.equal(
        rotated, out
    )
    register_ops()
    cl, pl = ops._cache_list(cache), ops._params_list(ep)
    args = (q, cl, pl, ep.has_mean, ep.rotated_output, bt, sl, ws, lo.group, D**-0.5)
    torch.library.opcheck(
        torch.ops.oscar.decode_attention.default, args, test_utils=("test_schema", "test_faketensor")
    )


def _extend_case(seed: int = 12):
    gen = torch.Generator().manual_seed(seed)
    lo = CacheLayout(2, D, page_size=8, sink_tokens=3, recent_tokens=5)
    lens, chunks = [9, 21], [4, 7]
    cache, params, bt, ws, keys, values = fill_cache(lo, lens, gen, "kv_head", pending=chunks)
    ep = params.expand(2, D, cache.device)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=DEVICE)
    prefix = torch.tensor(
        [n - c for n, c in zip(lens, chunks, strict=True)], dtype=torch.int32, device=DEVICE
    )
    q = torch.randn(11, 4, D, generator=gen).bfloat16().to(DEVICE)
    k = torch.cat([keys[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    v = torch.cat([values[b][n - c :] for b, (n, c) in enumerate(zip(lens, chunks, strict=True))])
    return lo, cache, ep, q, k, v, cu, prefix, bt, ws, max(chunks)


def test_extend_op_matches_and_passes_opcheck():
    from oscar_kernels import extend_attention
    from oscar_kernels.ops import _cache_list, _params_list, extend_attention_op

    lo, cache, ep, q, k, v, cu, prefix, bt, ws, mq = _extend_case()
    out = extend_attention_op(q, k, v, cache, ep, cu, prefix, bt, ws, mq)
    assert torch.equal(out, extend_attention(q, k, v, cache, ep, cu, prefix, bt, ws, mq))
    kept = replace(ep, rotated_output=True)
    rotated = extend_attention_op(q, k, v, cache, kept, cu, prefix, bt, ws, mq)
    assert torch.equal(rotated, extend_attention(q, k, v, cache, kept, cu, prefix, bt, ws, mq))
    assert not torch.equal(rotated, out)
    args = (
        q,
        k,
        v,
        _cache_list(cache),
        _params_list(ep),
        ep.has_mean,
        ep.rotated_output,
        cu,
        prefix,
        bt,
        ws,
        mq,
        lo.group,
        D**-0.5,
    )
    torch.library.opcheck(
        torch.ops.oscar.extend_attention.default, args, test_utils=("test_schema", "test_faketensor")
    )


def test_write_op_writes_what_paged_write_writes_and_declares_the_cache_mutated():
    """The op writes the same bytes as :func:`paged_write` into the cache it is given, and its
    schema names the cache as written and nothing else (without that declaration a compiled graph
    may reorder or drop the write; opcheck's schema test does not see mutations inside a list)."""
    from oscar_kernels import paged_write
    from oscar_kernels.ops import _cache_list, _params_list, paged_write_op

    lo, cache, ep, q, k, v, cu, prefix, bt, ws, mq = _extend_case(13)
    seq = torch.repeat_interleave(torch.arange(2, dtype=torch.int32), torch.tensor([4, 7])).to(DEVICE)
    pos = torch.cat([torch.arange(5, 9), torch.arange(14, 21)]).to(DEVICE)
    slots = (bt[seq.long(), pos // 8].long() * 8 + pos % 8).to(DEVICE)
    sl = torch.tensor([9, 21], dtype=torch.int32, device=DEVICE)
    twin = type(cache)(cache.layout, *[t.clone() for t in _cache_list(cache)])
    paged_write(twin, ep, k, v, slots, pos, seq, sl, ws, parts="ring")
    paged_write_op(cache, ep, k, v, slots, pos, seq, sl, ws, parts="ring")
    for a, b in zip(_cache_list(cache), _cache_list(twin), strict=True):
        assert torch.equal(a, b)
    register_ops()
    schema = torch.ops.oscar.paged_write.default._schema
    written = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["cache"], written
    args = (k, v, _cache_list(cache), _params_list(ep), ep.has_mean, slots, pos, seq, sl, ws, lo.group, "all")
    torch.library.opcheck(
        torch.ops.oscar.paged_write.default, args, test_utils=("test_schema", "test_faketensor")
    )
