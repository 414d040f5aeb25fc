import torch
from conftest import DEVICE, fill_cache

from oscar_kernels import CacheLayout, decode_attention
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
    register_ops()
    c = cache
    args = (
        q,
        c.k_codes,
        c.v_codes,
        c.k_scale,
        c.k_zero,
        c.v_scale,
        c.v_zero,
        c.k_sink,
        c.v_sink,
        c.k_recent,
        c.v_recent,
        ep.k_rotation.contiguous(),
        ep.v_rotation.contiguous(),
        ep.k_mean,
        ep.k_clip,
        ep.v_clip,
        bt,
        sl,
        ws,
        lo.group,
        32**-0.5,
    )
    torch.library.opcheck(
        torch.ops.oscar.decode_attention.default, args, test_utils=("test_schema", "test_faketensor")
    )
