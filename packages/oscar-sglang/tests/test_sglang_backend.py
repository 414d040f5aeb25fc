"""oscar-sglang against SGLang 0.5.23's real classes, on CPU (torch references of the kernels).

Skipped with a reason where SGLang is not installed (``nox -s sglang`` installs it).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.plugins", reason="SGLang not installed (nox -s sglang installs 0.5.23)")

from harness import (  # noqa: E402
    H_KV,
    H_Q,
    PAGE,
    RECENT,
    SINK,
    D,
    Harness,
    make_artifact,
    qkv,
    rel,
    scheduler,
    sglang_release,
)

from oscar_math import dequantize_int2, quantize_int2  # noqa: E402
from oscar_math.errors import ArtifactError, OscarError  # noqa: E402
from oscar_sglang import core  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def plugins():
    from sglang.srt.plugins import load_plugins

    load_plugins()  # SGLang's own loader: entry point -> oscar_sglang.sglang_glue.register -> hooks applied


@pytest.fixture
def topology():
    """Publish SGLang's runtime context (what the launcher does per process), as SGLang 0.5.23's own
    ``sglang.test.test_utils.published_topology`` does (that module itself needs the datasets
    package). SGLang 0.5.17's ``publish`` takes no ranks and reads the topology live from
    ``parallel_state``: its test hook ``get_parallel().override`` sets the attention ranks instead."""
    import contextlib

    from sglang.srt.runtime_context import get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    stack = contextlib.ExitStack()

    def pub(tp_size: int = 1, world_rank: int = 0) -> None:
        stack.close()
        reset_context()
        args = ServerArgs(model_path="dummy", tp_size=tp_size, device="cpu")
        if sglang_release() == "0.5.17":
            publish(args, role="test")
            rank = world_rank % tp_size
            stack.enter_context(
                get_parallel().override(attn_tp_size=tp_size, attn_tp_rank=rank, attn_dcp_size=1)
            )
        else:
            from sglang.srt.runtime_context import SpawnRanks

            publish(args, role="test", ranks=SpawnRanks(world_rank=world_rank, dp_rank=None))

    pub()
    yield pub
    stack.close()
    reset_context()


@pytest.fixture
def artifact(tmp_path, monkeypatch):
    path = tmp_path / "rot.safetensors"
    make_artifact(path)
    monkeypatch.setenv(core.ENV_ROTATIONS, str(path))
    return path


def _model_dir(tmp_path, *, layers=3, heads=4, kv_heads=2, head_dim=128):
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * head_dim,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_hidden_layers": layers,
        "intermediate_size": 256,
        "vocab_size": 1000,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


# --------------------------------------------------------------------------- registration


def test_entry_points_declared():
    eps = {ep.name: ep.value for ep in md.entry_points(group="sglang.srt.plugins")}
    assert eps.get("oscar") == "oscar_sglang.sglang_glue:register"
    assert any(ep.name == "sglang" for ep in md.entry_points(group="oscar"))


def test_plugin_discovered_in_fresh_process():
    """A new interpreter (like SGLang's scheduler subprocess) finds the plugin through load_plugins()."""
    code = (
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS\n"
        "from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES\n"
        "from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator as C\n"
        "from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator as K\n"
        "from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache as T\n"
        "from oscar_sglang.compat import adapter\n"
        "publish = [m for m, _ in adapter().publish_hooks(print)]\n"
        "print('oscar' in ATTENTION_BACKENDS, 'oscar' in ATTENTION_BACKEND_CHOICES,\n"
        "      hasattr(C._compute_cell_size, '__wrapped__'),\n"
        "      hasattr(K._build_token_to_kv_pool, '__wrapped__'),\n"
        "      all(hasattr(getattr(T, m), '__wrapped__') for m in ['match_prefix', *publish]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-5:] == ["True"] * 5


def test_sglang_parser_accepts_oscar(tmp_path):
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--attention-backend", "oscar", "--oscar-rotations", "r.st"])
    assert ns.attention_backend == "oscar" and ns.oscar_rotations == "r.st"
    with pytest.raises(SystemExit):  # the choices are still closed for anything else
        parser.parse_args(["--model-path", "m", "--attention-backend", "no-such-backend"])


def test_server_args_route_rotations_to_env(tmp_path, monkeypatch):
    import argparse

    from sglang.srt.server_args import ServerArgs

    monkeypatch.delenv(core.ENV_ROTATIONS, raising=False)
    model = _model_dir(tmp_path)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    missing = tmp_path / "nope.safetensors"
    ns = parser.parse_args(
        # --device: SGLang 0.5.17 finds no accelerator on a CPU-only machine otherwise
        [
            "--model-path",
            str(model),
            "--device",
            "cpu",
            "--attention-backend",
            "oscar",
            "--oscar-rotations",
            str(missing),
        ]
    )
    with pytest.raises(ArtifactError, match="rotations file not found") as e:
        ServerArgs.from_cli_args(ns)
    assert "\n" not in str(e.value)
    import os

    assert os.environ[core.ENV_ROTATIONS] == str(missing)  # what the scheduler subprocesses inherit


# --------------------------------------------------------------------------- pool and memory


def _configurator_ns(tmp_path, page=64):
    from sglang.srt.configs.model_config import ModelConfig

    mc = ModelConfig(str(_model_dir(tmp_path)))
    return SimpleNamespace(
        model_config=mc,
        server_args=SimpleNamespace(
            attention_backend="oscar", enable_hisparse=False, enable_dsa_cache_layer_split=False
        ),
        page_size=page,
        use_mla_backend=False,
        is_draft_worker=False,
        is_hybrid_swa=False,
        mambaish_config=None,
        device="cpu",
        kv_cache_dtype=torch.bfloat16,
        layer_info=SimpleNamespace(
            start_layer=0, end_layer=mc.num_hidden_layers, num_effective_layers=mc.num_hidden_layers
        ),
    )


def test_capacity_vs_bf16_pool_at_same_budget(tmp_path, monkeypatch, topology):
    """Cell size and window accounting through SGLang's (hooked) DefaultPoolConfigurator and pool builder."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator, MemoryPoolConfig

    art = tmp_path / "r128.safetensors"
    make_artifact(art, layers=3, kv_heads=2, d=128, granularity="layer")
    monkeypatch.setenv(core.ENV_ROTATIONS, str(art))
    # the request slots' windows alone (test_sglang_radix.py counts the radix snapshots on top)
    monkeypatch.setenv(core.ENV_RADIX, "off")
    kvc = _configurator_ns(tmp_path)
    conf = object.__new__(DefaultPoolConfigurator)  # only the two methods under test are used
    conf.kv_cache_dtype_str = None
    bf16_cell = DefaultPoolConfigurator._compute_cell_size.__wrapped__(conf, kvc, 3)
    cell = DefaultPoolConfigurator._compute_cell_size(conf, kvc, 3)
    assert bf16_cell == 2 * 2 * 128 * 3 * 2  # SGLang's own number: H_kv * (d + d) * layers * 2 bytes
    assert cell == 3 * 2 * 2 * (128 // 4 + 4)  # codes + bf16 scale/zero, K and V
    assert bf16_cell / cell == pytest.approx(7.11, abs=0.01)

    budget = 64 << 20
    reqs = 8
    cfg = MemoryPoolConfig(max_total_num_tokens=budget // cell // 64 * 64, max_running_requests=reqs)
    cfg = DefaultPoolConfigurator.finalize_with_max_running_requests(conf, cfg)
    tokens = cfg.max_total_num_tokens
    bf16_tokens = budget // bf16_cell // 64 * 64
    windows = core.window_bytes_per_slot(conf._oscar_layout, 3) * (reqs + 1)
    assert tokens % 64 == 0 and tokens * cell + windows <= budget
    assert tokens / bf16_tokens > 6.5  # ~7.1x, less the windows of 9 request slots

    req_pool = ReqToTokenPool(size=reqs, max_context_len=512, device="cpu", enable_memory_saver=False)
    sizes = SimpleNamespace(max_total_num_tokens=tokens)
    pool = KVCacheConfigurator._build_token_to_kv_pool(
        kvc, sizes=sizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=req_pool
    )
    assert type(pool).__name__ == "OscarTokenToKVPool" and isinstance(pool, MHATokenToKVPool)
    assert pool.caches[0].max_seqs == reqs + 1 == req_pool.req_to_token.shape[0]
    real = pool.get_kv_size_bytes()  # page buffers + windows, what SGLang logs and accounts
    assert real <= budget + 3 * core.page_bytes(pool.layout)  # + SGLang's padding page per layer
    ref = MHATokenToKVPool(
        bf16_tokens,
        page_size=64,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=128,
        layer_num=3,
        device="cpu",
        enable_memory_saver=False,
    )
    k, v = ref.get_kv_size_bytes()
    assert k + v <= budget + 3 * 2 * 64 * 2 * 128 * 2


def test_write_read_roundtrip_vs_reference_quantiser(artifact):
    h = Harness(artifact)
    slot = h.new_request(20)
    q, k, v = qkv(20, 3)
    fb = h.batch("extend", [slot], [0], [20])
    h.oscar.init_forward_metadata(fb)
    h.pool.set_kv_buffer(h.layer, fb.out_cache_loc, k, v)  # extend step: INT2 rows + sink
    cache = h.pool.cache(0)
    assert not cache.v_recent[slot].any()  # the ring rows are written after attention
    h.pool.write_ring(h.layer, fb.out_cache_loc, k, v)
    ep, lo = h.pool.params(0), h.pool.layout
    k_rot = torch.einsum("nhd,hde->nhe", k.float() - ep.k_mean, ep.k_rotation)
    v_rot = torch.einsum("nhd,hde->nhe", v.float(), ep.v_rotation)
    locs = fb.out_cache_loc
    page, off = locs // PAGE, locs % PAGE
    for x, codes, scale, zero, clip in (
        (k_rot, cache.k_codes, cache.k_scale, cache.k_zero, ep.k_clip),
        (v_rot, cache.v_codes, cache.v_scale, cache.v_zero, ep.v_clip),
    ):
        ref = quantize_int2(x, lo.group, clip.view(-1, 1))
        assert torch.equal(codes[page, :, off], ref.codes)
        assert torch.equal(scale[page, :, off], ref.scale) and torch.equal(zero[page, :, off], ref.zero)
    # windows: sink rows 0..3, ring rows for the last 8 positions, bf16 in the rotated basis
    assert torch.equal(cache.k_sink[slot].transpose(0, 1), k_rot[:SINK].bfloat16())
    ring = torch.arange(20 - RECENT, 20)
    assert torch.equal(cache.v_recent[slot][:, ring % RECENT].transpose(0, 1), v_rot[ring].bfloat16())


# --------------------------------------------------------------------------- attention


def _oracle(h: Harness, q, k, v, q_pos, int2_before: int = 0):
    """float64 attention of queries at ``q_pos`` over keys ``0..max(q_pos)``, per query token.

    Key ``j`` of query ``t`` is the reference quantiser's INT2 value iff ``SINK <= j <= t - RECENT``
    (extend and decode alike), else bf16 of the rotated key; ``j < int2_before`` forces INT2
    even in the windows (radix-hit prefixes, whose window rows are rebuilt from INT2).
    """
    ep, lo = h.pool.params(0), h.pool.layout
    n = max(q_pos) + 1
    k_rot = torch.einsum("nhd,hde->nhe", k[:n].double() - ep.k_mean.double(), ep.k_rotation.double())
    v_rot = torch.einsum("nhd,hde->nhe", v[:n].double(), ep.v_rotation.double())
    kq = dequantize_int2(quantize_int2(k_rot.float(), lo.group, ep.k_clip.view(-1, 1))).double()
    vq = dequantize_int2(quantize_int2(v_rot.float(), lo.group, ep.v_clip.view(-1, 1))).double()
    kb, vb = k_rot.bfloat16().double(), v_rot.bfloat16().double()
    qr = torch.einsum("mhd,hde->mhe", q.double(), ep.k_rotation.double().repeat_interleave(H_Q // H_KV, 0))
    j = torch.arange(n)
    outs = []
    for i, t in enumerate(q_pos):
        win = ((j < SINK) | (j > t - RECENT)) & (j >= int2_before)
        kk = torch.where(win[:, None, None], kb, kq)[: t + 1].repeat_interleave(H_Q // H_KV, 1)
        vv = torch.where(win[:, None, None], vb, vq)[: t + 1].repeat_interleave(H_Q // H_KV, 1)
        s = torch.einsum("hd,nhd->hn", qr[i], kk) / math.sqrt(D)
        outs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), vv))
    o = torch.stack(outs)
    return torch.einsum("mhe,hde->mhd", o, ep.v_rotation.double().repeat_interleave(H_Q // H_KV, 0))


def test_extend_and_decode_inside_windows_match_torch_native(artifact):
    """Sequences never longer than sink + recent: every key is BF16, so OSCAR == SGLang's BF16 backend
    up to the bf16 rounding of the rotated keys/values (2^-9 relative per element)."""
    h = Harness(artifact)
    lens = [5, 9]
    slots = [h.new_request(12) for _ in lens]
    data = [qkv(12, 10 + i) for i in range(2)]
    q = torch.cat([d[0][:n] for d, n in zip(data, lens, strict=True)])
    k = torch.cat([d[1][:n] for d, n in zip(data, lens, strict=True)])
    v = torch.cat([d[2][:n] for d, n in zip(data, lens, strict=True)])
    fb = h.batch("extend", slots, [0, 0], lens)
    assert rel(h.run(h.oscar, fb, q, k, v), h.run(h.native, fb, q, k, v)) < 1e-2
    for step in range(3):  # 3 decode steps: lengths 6..8 and 10..12 (still inside sink + recent = 12)
        pos = [n + step for n in lens]
        fb = h.batch("decode", slots, pos, [1, 1])
        qs = torch.stack([data[i][0][pos[i]] for i in range(2)])
        ks = torch.stack([data[i][1][pos[i]] for i in range(2)])
        vs = torch.stack([data[i][2][pos[i]] for i in range(2)])
        assert rel(h.run(h.oscar, fb, qs, ks, vs), h.run(h.native, fb, qs, ks, vs)) < 1e-2


def test_chunked_extend_and_decode_int2_within_bound(artifact):
    """Longer sequences: INT2 tokens enter. OSCAR must equal a float64 oracle built with the reference
    quantiser (bf16-level tolerance), so its distance to SGLang's BF16 backend is the INT2 error itself."""
    h = Harness(artifact)
    L = 40
    slot = h.new_request(L + 4)
    q, k, v = qkv(L + 4, 21)
    outs, nat, orc = [], [], []
    for a, b in ((0, 24), (24, L)):  # chunked prefill: the second chunk reads the first from the cache
        fb = h.batch("extend", [slot], [a], [b - a])
        outs.append(h.run(h.oscar, fb, q[a:b], k[a:b], v[a:b]))
        nat.append(h.run(h.native, fb, q[a:b], k[a:b], v[a:b]))
        orc.append(_oracle(h, q[a:b], k, v, list(range(a, b))))
    for p in range(L, L + 4):
        fb = h.batch("decode", [slot], [p], [1])
        outs.append(h.run(h.oscar, fb, q[p : p + 1], k[p : p + 1], v[p : p + 1]))
        nat.append(h.run(h.native, fb, q[p : p + 1], k[p : p + 1], v[p : p + 1]))
        orc.append(_oracle(h, q[p : p + 1], k, v, [p]))
    for o, n, r in zip(outs, nat, orc, strict=True):
        assert rel(o, r) < 2e-2  # kernels == reference-quantiser oracle
        assert rel(o, n) <= rel(r, n) + 2e-2  # distance to BF16 == the INT2 error, nothing more
    assert max(rel(o, n) for o, n in zip(outs[1:], nat[1:], strict=True)) > 2e-2  # INT2 is really in play


def test_long_prefill_chunks_through_a_dense_kernel_equal_the_triton_path(artifact):
    """A chunk of >= 128 tokens (oscar_kernels.DENSE_MIN_QUERY) runs through the dense kernel the
    backend picked at start-up (on a GPU sgl_kernel's FA3 or torch's FA2, each checked first; here
    the kernel's torch reference stands in): the same outputs as without it, and the oracle's."""
    pytest.importorskip("triton", reason="the Triton path runs under its interpreter here (conftest.py)")
    from oscar_kernels import dense_attention_ref

    calls = []

    def counted(*args):  # noqa: ANN002, ANN202
        calls.append(args[0].shape[0])
        return dense_attention_ref(*args)

    L = 200
    q, k, v = qkv(L, 23)
    outs = {}
    for name, dense in (("triton", None), ("dense", counted)):
        h = Harness(artifact, num_tokens=512, max_context=256)
        assert h.oscar.dense is None  # a CPU backend picks no dense kernel
        h.oscar.dense = dense
        h.oscar.kernel_backend = "triton"  # the dense split lives in the Triton path
        slot = h.new_request(L)
        outs[name] = []
        for a, b in ((0, 140), (140, L)):  # the second chunk (60 tokens) stays on the extend kernel
            fb = h.batch("extend", [slot], [a], [b - a])
            outs[name].append(h.run(h.oscar, fb, q[a:b], k[a:b], v[a:b]))
    assert calls and set(calls) == {140}, calls  # the long chunk only, each layer call twice (far, near)
    oracle = _oracle(h, q[:140], k, v, list(range(140)))
    assert rel(outs["dense"][0], oracle) < 2e-2
    assert rel(outs["dense"][0], outs["triton"][0]) < 1e-2
    assert torch.equal(outs["dense"][1], outs["triton"][1])  # same cache contents after the dense chunk


def test_radix_hit_reads_no_stale_rows_and_equals_int2_prefix(artifact):
    """A prefix from the radix cache (pages shared with another request) in a reused request slot,
    mode int2 (approximate hits: the prefix's window rows rebuilt from its INT2 pages)."""
    h = Harness(artifact, radix="int2")
    P, C = 24, 6
    q, k, v = qkv(P + C, 31)
    donor = h.new_request(P)
    h.run(h.oscar, h.batch("extend", [donor], [0], [P]), q[:P], k[:P], v[:P])
    # an unrelated request leaves its BF16 rows in a slot, then frees it
    other = h.new_request(16)
    qo, ko, vo = qkv(16, 99, scale=5.0)
    h.run(h.oscar, h.batch("extend", [other], [0], [16]), qo, ko, vo)
    scheduler().free_row(h.req_pool, other)
    hit = h.new_request(P + C, share_from=(donor, P))
    assert hit == other  # SGLang reuses the row (req_generation bumped)
    fb = h.batch("extend", [hit], [P], [C])
    out_hit = h.run(h.oscar, fb, q[P:], k[P:], v[P:])
    fresh = h.new_request(P + C, share_from=(donor, P))  # never-used slot, same hit
    out_fresh = h.run(h.oscar, h.batch("extend", [fresh], [P], [C]), q[P:], k[P:], v[P:])
    assert torch.equal(out_hit, out_fresh)  # nothing of the previous owner is read
    oracle = _oracle(h, q[P:], k, v, list(range(P, P + C)), int2_before=P)
    assert rel(out_hit, oracle) < 2e-2
    # the miss (whole prompt in one chunk) reads the prefix windows in BF16: it differs from the
    # hit (rebuilt INT2 rows) by exactly the INT2 error of those keys, as the float64 oracle measures it
    miss = h.new_request(P + C)
    out_miss = h.run(h.oscar, h.batch("extend", [miss], [0], [P + C]), q, k, v)[P:]
    # the same request prefilled in two chunks by itself (no radix) keeps its BF16 prefix windows
    own = h.new_request(P + C)
    h.run(h.oscar, h.batch("extend", [own], [0], [P]), q[:P], k[:P], v[:P])
    out_own = h.run(h.oscar, h.batch("extend", [own], [P], [C]), q[P:], k[P:], v[P:])
    oracle_own = _oracle(h, q[P:], k, v, list(range(P, P + C)))
    assert rel(out_own, oracle_own) < 2e-2 and rel(out_own, out_hit) > 1e-3
    # windows per query token: two chunks == one chunk (only float32 summation order differs)
    assert rel(out_own, out_miss) < 1e-5
    assert rel(out_hit, out_miss) <= rel(oracle, out_miss) + 2e-2
    # decoding after the hit keeps working (own tokens go to the BF16 ring)
    qd, kd, vd = qkv(1, 77)
    fb = h.batch("decode", [hit], [P + C], [1])
    out_dec = h.run(h.oscar, fb, qd, kd, vd)
    kk, vv = torch.cat([k, kd]), torch.cat([v, vd])
    qq = torch.cat([q, qd])[-1:]
    assert rel(out_dec, _oracle(h, qq, kk, vv, [P + C], int2_before=P)) < 2e-2


def test_tensor_parallel_sharding(tmp_path, monkeypatch, topology):
    from oscar_kernels import allocate_cache, decode_attention, paged_write

    art = tmp_path / "tp.safetensors"
    rot = make_artifact(art, layers=2, kv_heads=4, d=64)
    assert core.kv_heads_of_rank(4, 2, 1) == [2, 3]
    assert [core.kv_heads_of_rank(2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    with pytest.raises(OscarError, match="do not split"):
        core.kv_heads_of_rank(3, 2, 0)
    kw = dict(num_layers=2, total_kv_heads=4, head_dim=64, v_head_dim=64, page_size=PAGE)
    full = core.load_rank_quant(str(art), **kw)
    ranks = [core.load_rank_quant(str(art), tp_size=2, tp_rank=r, **kw) for r in range(2)]
    for r, rq in enumerate(ranks):
        assert rq.layout.num_kv_heads == 2 and rq.heads == [2 * r, 2 * r + 1]
        assert torch.equal(rq.params[1].k_rotation, rot.k_rotation[1][2 * r : 2 * r + 2])
        assert torch.equal(rq.params[1].k_mean, rot.k_mean[1][2 * r : 2 * r + 2])
    # the pool builder takes this process's attention-TP rank from SGLang's runtime context
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    art128 = tmp_path / "tp128.safetensors"
    rot128 = make_artifact(art128, layers=3, kv_heads=2, d=128)
    monkeypatch.setenv(core.ENV_ROTATIONS, str(art128))
    topology(tp_size=2, world_rank=1)
    kvc = _configurator_ns(tmp_path)
    req_pool = ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    pool = KVCacheConfigurator._build_token_to_kv_pool(
        kvc,
        sizes=SimpleNamespace(max_total_num_tokens=256),
        is_dsa_model=False,
        is_dsv4_model=False,
        req_to_token_pool=req_pool,
    )
    assert pool.quant.heads == [1] and pool.layout.num_kv_heads == 1
    assert torch.equal(pool.params(2).v_rotation, rot128.v_rotation[2][1:2])
    # attention sharded by heads == the unsharded attention, head by head
    g = torch.Generator().manual_seed(5)
    n = 30
    k, v = torch.randn(n, 4, 64, generator=g), torch.randn(n, 4, 64, generator=g)
    qd = torch.randn(1, 8, 64, generator=g)
    slots = torch.arange(n)
    args = (slots, torch.arange(n), torch.zeros(n, dtype=torch.int64), torch.tensor([n]), torch.tensor([0]))
    bt = torch.arange(-(-n // PAGE), dtype=torch.int32)[None]

    def run(rq, kk, vv, qq):
        cache = allocate_cache(rq.layout, num_pages=bt.shape[1], max_seqs=1)
        paged_write(cache, rq.params[1], kk, vv, *args)
        return decode_attention(
            qq,
            cache,
            rq.params[1],
            bt,
            torch.tensor([n], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
        )

    whole = run(full, k, v, qd)
    parts = [
        run(ranks[r], k[:, 2 * r : 2 * r + 2], v[:, 2 * r : 2 * r + 2], qd[:, 4 * r : 4 * r + 4])
        for r in range(2)
    ]
    torch.testing.assert_close(torch.cat(parts, 1), whole, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- start-up errors


def test_startup_errors_are_one_line(tmp_path, monkeypatch, topology):
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    req_pool = ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    sizes = SimpleNamespace(max_total_num_tokens=256)
    kvc = _configurator_ns(tmp_path)  # head_dim 128, 2 KV heads, 3 layers

    def build():
        return KVCacheConfigurator._build_token_to_kv_pool(
            kvc, sizes=sizes, is_dsa_model=False, is_dsv4_model=False, req_to_token_pool=req_pool
        )

    cases = []
    monkeypatch.delenv(core.ENV_ROTATIONS, raising=False)
    cases.append(("needs a rotations artifact", None))
    cases.append(("rotations file not found", tmp_path / "missing.safetensors"))
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x00garbage" * 8)
    cases.append(("corrupt.safetensors", corrupt))
    wrong = tmp_path / "wrong.safetensors"
    make_artifact(wrong, layers=3, kv_heads=2, d=64)  # calibrated for head_dim 64
    cases.append(("head_dim mismatch", wrong))
    for match, path in cases:
        if path is not None:
            monkeypatch.setenv(core.ENV_ROTATIONS, str(path))
        with pytest.raises(OscarError, match=match) as e:
            build()
        assert "\n" not in str(e.value) and str(e.value)
    with pytest.raises(OscarError, match="unsupported head dim 72"):
        core.check_geometry(72, 72)
    with pytest.raises(OscarError, match="MLA"):
        core.check_geometry(128, 64)
    with pytest.raises(OscarError, match="head dim 32 on a GPU"):
        core.check_geometry(32, 32, on_gpu=True)
    core.check_geometry(32, 32)  # the CPU references serve it


def test_backend_refuses_a_bf16_pool(artifact):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from oscar_sglang.sglang_glue import OscarAttnBackend

    pool = MHATokenToKVPool(
        64,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=H_KV,
        head_dim=D,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    with pytest.raises(OscarError, match="needs the OSCAR KV pool"):
        OscarAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=None, token_to_kv_pool=pool))


def test_backend_selection_and_forward_modes(artifact):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from oscar_sglang.sglang_glue import oscar_selected

    assert oscar_selected(SimpleNamespace(attention_backend="oscar", decode_attention_backend=None))
    assert not oscar_selected(SimpleNamespace(attention_backend="torch_native"))
    with pytest.raises(OscarError, match="do not combine it with \\['fa3'\\]"):
        oscar_selected(SimpleNamespace(attention_backend="oscar", prefill_attention_backend="fa3"))
    h = Harness(artifact)
    slot = h.new_request(8)
    fb = h.batch("extend", [slot], [0], [8])
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    with pytest.raises(OscarError, match="forward mode TARGET_VERIFY is not supported"):
        h.oscar.init_forward_metadata(fb)
    fb.forward_mode = ForwardMode.IDLE
    h.oscar.init_forward_metadata(fb)
    assert h.oscar.plan is None


def test_mixed_batch_decode_token_plus_new_prompt(artifact):
    """A MIXED batch (chunked-prefill scheduling): one running request's next token as a 1-token
    extend next to a new prompt; all keys inside the windows, so OSCAR == torch-native."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    h = Harness(artifact)
    a, b = h.new_request(8), h.new_request(8)
    qa, ka, va = qkv(8, 41)
    qb, kb, vb = qkv(8, 42)
    for be in (h.oscar, h.native):
        h.run(be, h.batch("extend", [a], [0], [5]), qa[:5], ka[:5], va[:5])
    fb = h.batch("extend", [a, b], [5, 0], [1, 6])
    fb.forward_mode = ForwardMode.MIXED
    q, k, v = (torch.cat([x[5:6], y[:6]]) for x, y in ((qa, qb), (ka, kb), (va, vb)))
    assert rel(h.run(h.oscar, fb, q, k, v), h.run(h.native, fb, q, k, v)) < 1e-2


# --------------------------------------------------------------------------- releases


def test_release_adapter_and_cuda_graph_interface():
    """The adapter matches the installed SGLang, and every method SGLang's CUDA-graph runners call
    on an attention backend (the release's ``CUDA_GRAPH_CALLS``) is declared by SGLang's base class
    and takes the runner's arguments on OscarAttnBackend. The legacy capture/replay pair exists in
    neither release: a backend overriding it would never be called."""
    import inspect

    import sglang
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    from oscar_sglang import sglang_glue
    from oscar_sglang.compat import adapter, release_of
    from oscar_sglang.sglang_glue import OscarAttnBackend

    ad = adapter()
    assert sglang_glue.SGLANG_VERSION == ad.VERSION == release_of(sglang.__version__) == sglang_release()
    for name, (args, kwargs) in ad.CUDA_GRAPH_CALLS.items():
        assert callable(getattr(AttentionBackend, name)), name
        inspect.signature(getattr(OscarAttnBackend, name)).bind(None, *args, **dict.fromkeys(kwargs))
    for legacy in ("init_forward_metadata_capture_cuda_graph", "init_forward_metadata_replay_cuda_graph"):
        assert not hasattr(AttentionBackend, legacy) and legacy not in vars(OscarAttnBackend)
    with pytest.raises(OscarError, match="supports SGLang 0.5.17 and 0.5.23, found SGLang 0.6.0") as e:
        adapter("0.6.0")
    assert "\n" not in str(e.value)


def test_row_generation_stays_monotonic_across_a_cache_flush():
    """``flush_cache`` clears the request pool; the window bookkeeping reads an unchanged
    ``req_generation`` as "the same request still owns this row", so a row handed out after the
    flush must get a new generation (0.5.23 keeps it; on 0.5.17 the plugin's hook does)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=2, max_context_len=8, device="cpu", enable_memory_saver=False)
    s = scheduler()
    row = s.alloc_row(pool)
    before = int(pool.req_generation[row])
    pool.clear()
    assert s.alloc_row(pool) == row and int(pool.req_generation[row]) > before


def test_cuda_graph_decode_path_equals_eager_and_padding_writes_nothing(artifact):
    """The decode graph path (init_cuda_graph_state + init_forward_metadata_out_graph, as SGLang's
    runner calls them, padded to a captured batch size) gives the eager step's outputs for the real
    rows, keeps the plan in the fixed buffers across steps, and its padding row writes nothing: the
    slot it points at (a live request's) keeps its pages and windows."""
    import copy
    from types import SimpleNamespace

    h = Harness(artifact)
    a, b = h.new_request(40), h.new_request(40)
    for s, seed in ((a, 61), (b, 62)):  # prefill 20 tokens each
        q, k, v = qkv(20, seed)
        h.run(h.oscar, h.batch("extend", [s], [0], [20]), q, k, v)
    graph = h.oscar
    graph.init_cuda_graph_state(4, 4)
    assert graph.get_cuda_graph_seq_len_fill_value() == 1
    held = None
    for step in range(3):
        pos = 20 + step
        q, k, v = qkv(2, 70 + step)
        fb = h.batch("decode", [a, b], [pos, pos], [1, 1])
        snap = copy.deepcopy(h.pool.caches[0])
        want = h.run(graph, fb, q, k, v)  # eager
        eager_cache = h.pool.caches[0]
        h.pool.caches[0] = snap  # the same step again through the graph path, padded to 3 rows
        h.oscar.pool.caches[0] = snap
        pad = SimpleNamespace(
            batch_size=3,
            forward_mode=fb.forward_mode,
            req_pool_indices=torch.cat([fb.req_pool_indices, fb.req_pool_indices[:1]]),  # pads point at a
            seq_lens=torch.cat([fb.seq_lens, torch.ones(1, dtype=fb.seq_lens.dtype)]),
            seq_lens_cpu=torch.cat([fb.seq_lens_cpu, torch.ones(1, dtype=fb.seq_lens_cpu.dtype)]),
            out_cache_loc=torch.cat([fb.out_cache_loc, torch.zeros(1, dtype=fb.out_cache_loc.dtype)]),
            num_padding=1,
        )
        graph.init_forward_metadata_out_graph(pad)
        if held is None:
            held = graph.plan.seq_lens.data_ptr()
        assert graph.plan.seq_lens.data_ptr() == held  # the fixed buffers a replay reads
        assert graph.plan.slot_mapping[2].item() == -1  # the padding row writes nothing
        qp = torch.cat([q, q[:1]])
        kp, vp = torch.cat([k, k[:1]]), torch.cat([v, v[:1]])
        got = graph.forward_decode(qp.reshape(3, -1), kp, vp, h.layer, pad).reshape(qp.shape)
        assert torch.equal(got[:2], want)
        for f in ("k_codes", "v_codes", "k_scale", "v_scale", "k_sink", "v_sink", "k_recent", "v_recent"):
            assert torch.equal(getattr(snap, f), getattr(eager_cache, f)), f
        h.pool.caches[0] = eager_cache
        h.oscar.pool.caches[0] = eager_cache


def test_default_slot_count_when_the_user_gives_none(tmp_path, monkeypatch, topology):
    """Without --max-running-requests, SGLang's own default (up to 4096 slots) gives way to OSCAR's:
    the slots whose BF16 windows fit WINDOW_MEMORY_SHARE of the device (on the H100 SGLang's default
    made start-up fail: the windows did not fit the budget). A user's --max-running-requests is kept."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator, MemoryPoolConfig

    from oscar_kernels.serving import WINDOW_MEMORY_SHARE

    art = tmp_path / "r128.safetensors"
    make_artifact(art, layers=3, kv_heads=2, d=128, granularity="layer")
    monkeypatch.setenv(core.ENV_ROTATIONS, str(art))
    monkeypatch.setenv(core.ENV_RADIX, "off")
    device = 1 << 30  # this tiny model's windows: ~2,330 slots in 8 % of it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=device))

    def slots(user: int | None) -> tuple[int, int]:
        kvc = _configurator_ns(tmp_path)
        kvc.server_args.max_running_requests = user
        conf = object.__new__(DefaultPoolConfigurator)
        conf.kv_cache_dtype_str = None
        DefaultPoolConfigurator._compute_cell_size(conf, kvc, 3)
        cfg = MemoryPoolConfig(
            max_total_num_tokens=1 << 22, max_running_requests=4096 if user is None else user
        )
        cfg = DefaultPoolConfigurator.finalize_with_max_running_requests(conf, cfg)
        return cfg.max_running_requests, core.window_bytes_per_slot(conf._oscar_layout, 3)

    got, per_slot = slots(None)
    assert got == int(WINDOW_MEMORY_SHARE * device) // per_slot < 4096
    assert slots(3000)[0] == 3000  # the user's choice stands


def test_sglang_launcher_on_a_corrupt_artifact_ends_with_one_oscar_line(tmp_path):
    """SGLang's own launcher (a real process, the plugin loaded from its entry point) stops on a
    corrupt artifact while it parses its arguments; the last line it prints is ``OSCAR: <file>: …``
    (oscar_kernels.serving.exit_report), after SGLang's traceback, and the exit status is not 0."""
    import json
    import subprocess
    import sys

    bad = tmp_path / "corrupt.safetensors"
    bad.write_bytes(b"not a safetensors file")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
           "--attention-backend", "oscar", "--oscar-rotations", str(bad)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert run.returncode != 0
    oscar = [line for line in lines if line.startswith("OSCAR: ")]
    assert len(oscar) == 1 and lines[-1] == oscar[0] and str(bad) in oscar[0], lines[-10:]
