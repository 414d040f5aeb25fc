"""Radix (prefix) cache under OSCAR, through SGLang 0.5.23's real ``UnifiedRadixCache``, ``Req``,
allocator and pools on CPU (torch references of the kernels).

A hit of ``M`` cached tokens equals a miss exactly when the request reads, besides the shared INT2
pages, the BF16 rows a miss wrote for positions ``[0, sink)`` and ``(M - recent, M)``. Mode ``exact``
keeps those rows as window snapshots and cuts every hit back to a prefix that has one.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.plugins", reason="SGLang not installed (nox -s sglang installs 0.5.23)")

from harness import PAGE, RECENT, SINK, Harness, TreeFlow, make_artifact, near_bf16, rel  # noqa: E402
from test_sglang_backend import _configurator_ns, plugins  # noqa: E402, F401
from test_sglang_backend import topology as topology  # noqa: E402

from oscar_math.errors import OscarError  # noqa: E402
from oscar_sglang import core  # noqa: E402


@pytest.fixture
def artifact(tmp_path, monkeypatch):
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    path = tmp_path / "rot.safetensors"
    make_artifact(path)
    monkeypatch.setenv(core.ENV_ROTATIONS, str(path))
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PAGE))  # what Req reads
    return path


def _flow(artifact, radix="exact", snapshots=16, tree="unified"):
    h = Harness(artifact, num_tokens=1024, max_context=64, radix=radix, snapshots=snapshots)
    return TreeFlow(h, tree)


def _check_equal_to_miss(f: TreeFlow, tokens, outs, m, decode=0):
    """The hit's outputs equal the same request run with no radix cache: bitwise against the same
    prefill split at the hit (same chunk shapes); against a one-chunk miss the float32 summation
    order of the attention may differ (it does with torch's AVX-512 CPU kernels), which moves a few
    bf16 outputs by about one unit in their last place (:func:`harness.near_bf16`)."""
    own, m0, _ = f.run(tokens, decode=decode, chunks=(m,), use_tree=False)
    miss, _, _ = f.run(tokens, decode=decode, use_tree=False)
    assert m0 == 0
    for pos in outs:
        assert torch.equal(outs[pos], own[pos]), pos
        assert near_bf16(outs[pos], miss[pos]), (pos, rel(outs[pos], miss[pos]))


# --------------------------------------------------------------------------- exact hits


@pytest.mark.parametrize("tree", ["unified", "radix"])
def test_exact_hit_multi_turn_equals_miss(artifact, tree):
    """Turn 2 = turn 1's prompt + answer + a new message: the hit covers turn 1 up to its last page
    boundary (snapshot taken by a decode step, published when turn 1 finished). On SGLang's default
    ``UnifiedRadixCache`` and on the older ``RadixCache``."""
    f = _flow(artifact, tree=tree)
    _, m1, turn1 = f.run(range(1, 20), decode=6)  # 25 tokens with KV; finish publishes K = 24
    assert m1 == 0
    f.run([77] * 30, use_tree=False)  # an unrelated request takes turn 1's freed row and its windows
    turn2 = turn1 + [500 + i for i in range(6)]
    outs, m, _ = f.run(turn2, decode=3)
    assert m == 24 and f.h.pool.exact_hits == 1 and f.h.pool.inexact_hits == 0
    assert m - RECENT > SINK  # the hit's window rows are really needed: INT2 tokens lie between them
    _check_equal_to_miss(f, turn2, outs, m, decode=3)


def test_exact_hits_and_captures_in_one_batch(artifact):
    """Four requests prefilled in one extend batch and decoded together — hits of different lengths
    (restores), a miss, captures at the chunks' last page boundaries and at decode boundaries — each
    equal to the same request run alone without the radix cache; what the batch captured serves
    later hits exactly."""
    f = _flow(artifact, snapshots=24)
    _, _, a = f.run(range(1, 20), decode=6)  # publishes 16, 20, 24
    _, _, b = f.run(range(200, 219), decode=2)  # publishes 16, 20
    prompts = [
        a + [500, 501, 502],  # hit 24 (a's finish)
        list(range(600, 623)),  # miss
        b + [503, 504, 505, 506, 507],  # hit 20
        a[:18] + [508, 509],  # hit 16 (a's prompt checkpoint)
    ]
    reqs = [f.admit(p, decode=5) for p in prompts]
    assert [r.m for r in reqs] == [24, 0, 20, 16]
    f.extend(reqs)
    while any(r.done < r.total for r in reqs):
        f.decode(reqs)
    for r in reqs:
        f.finish(r)
    for r in reqs:
        _check_equal_to_miss(f, r.tokens[: r.n], r.outs, r.m, decode=5)
    assert f.h.pool.exact_hits == 3 and f.h.pool.inexact_hits == 0
    follow = reqs[1].tokens[: reqs[1].total] + [510, 511]  # the miss's finish (28) was published
    outs, m, _ = f.run(follow)
    assert m == 28
    _check_equal_to_miss(f, follow, outs, m)


def test_int2_mode_hit_differs_from_miss(artifact):
    """The same flow with mode int2 (window rows rebuilt from the INT2 pages) is measurably different:
    the comparisons above can see a hit that reads its prefix windows at INT2."""
    f = _flow(artifact, radix="int2", snapshots=0)
    _, _, turn1 = f.run(range(1, 20), decode=6)
    turn2 = turn1 + [500 + i for i in range(6)]
    outs, m, _ = f.run(turn2)
    assert m == 24 and f.h.pool.inexact_hits == 1
    miss, _, _ = f.run(turn2, use_tree=False)
    assert max(rel(outs[p], miss[p]) for p in outs) > 1e-3


@pytest.mark.parametrize("tree", ["unified", "radix"])
def test_exact_hit_cut_back_to_a_snapshot(artifact, tree):
    """Prefixes that end between snapshots: SGLang's match is cut back to the longest published one
    (16 = turn 1's prompt checkpoint, 20 = a decode boundary published at its finish) or to
    nothing; every result equals its miss."""
    f = _flow(artifact, tree=tree)
    _, _, base = f.run(range(1, 20), decode=6)  # published: 16 (prefill), 20 and 24 (finish)
    for diverge, want in ((18, 16), (22, 20), (13, 0), (26, 24)):
        tokens = base[:diverge] + [700 + diverge + i for i in range(7)]
        outs, m, _ = f.run(tokens)
        assert m == want, (diverge, m)
        _check_equal_to_miss(f, tokens, outs, m)
    assert f.h.pool.inexact_hits == 0


@pytest.mark.parametrize("tree", ["unified", "radix"])
def test_exact_hit_cut_back_inside_the_tree(artifact, tree):
    """SGLang matches 12 tokens, a page boundary with no snapshot, while the prefix's chunked
    prefill snapshotted 8: the hit is cut back to 8 by SGLang's own match of the shorter key (the
    tree splits its node there), and equals a miss."""
    f = _flow(artifact, tree=tree)
    _, _, base = f.run(range(1, 20), chunks=(9,))  # snapshots 8 (chunk 1) and 16 (prompt end)
    tokens = base[:14] + [800 + i for i in range(6)]
    outs, m, _ = f.run(tokens)
    assert m == 8
    _check_equal_to_miss(f, tokens, outs, m)
    assert f.h.pool.inexact_hits == 0 and f.h.pool.exact_hits == 1


@pytest.mark.parametrize("tree", ["unified", "radix"])
def test_hit_on_a_running_request(artifact, tree):
    """The same prompt arriving while the first request still decodes hits the snapshot that
    request's prefill published where the tree took its tokens (0.5.23: ``checkpoint``, 0.5.17:
    ``cache_unfinished_req``), before it finishes."""
    f = _flow(artifact, tree=tree)
    prompt = list(range(60, 79))  # 19 tokens: snapshot 16 at the end of the prefill
    a = f.admit(prompt, decode=3)
    f.extend([a])
    f.decode([a])
    tokens = prompt + [950, 951]
    outs, m, _ = f.run(tokens)
    assert m == 16
    _check_equal_to_miss(f, tokens, outs, m)
    while a.done < a.total:
        f.decode([a])
    f.finish(a)
    assert f.h.pool.inexact_hits == 0 and f.h.pool.exact_hits == 1


@pytest.mark.parametrize("tree", ["unified", "radix"])
def test_shared_system_prompt_second_request_plants_the_branch_snapshot(artifact, tree):
    """Requests that share only a system prompt: the first two recompute it (no snapshot where they
    branch), the second also snapshots the branch point SGLang's match reported, and from the
    third on the shared prefix is an exact hit."""
    f = _flow(artifact, tree=tree)
    system = list(range(300, 314))  # 14 tokens: the branch point is page_floor(14) = 12
    _, m1, _ = f.run(system + [1, 2, 3, 4, 5], decode=2)
    _, m2, _ = f.run(system + [6, 7, 8, 9, 10])
    assert (m1, m2) == (0, 0)
    for user in ([11, 12, 13], [14, 15, 16, 17, 18, 19]):
        tokens = system + user
        outs, m, _ = f.run(tokens, decode=2)
        assert m == 12
        _check_equal_to_miss(f, tokens, outs, m, decode=2)
    assert f.h.pool.inexact_hits == 0 and f.h.pool.exact_hits == 2


def test_repeated_prompt_hits_its_prefill_snapshot(artifact):
    """Same prompt again, chunked prefill the first time: the last chunk's page boundary snapshot
    (composed from the windows before the chunk and the chunk's own rows) serves the hit."""
    f = _flow(artifact)
    prompt = list(range(40, 63))  # 23 tokens, prefilled in chunks [0, 9), [9, 23)
    f.run(prompt, chunks=(9,))
    outs, m, _ = f.run(prompt + [900, 901, 902])
    assert m == 20
    _check_equal_to_miss(f, prompt + [900, 901, 902], outs, m)


def test_snapshot_store_pressure_stays_exact(artifact):
    """Three snapshot rows for many requests: snapshots are recycled (LRU), hits shrink or vanish,
    and every output still equals its miss; nothing is read at INT2 instead of BF16."""
    f = _flow(artifact, snapshots=3)
    prompts = [[s + i for i in range(14)] for s in (100, 200, 300)]
    for p in prompts:
        f.run(p, decode=3)  # each publishes 12 (prompt checkpoint) and 16 (finish)
    runs = [(p + [5, 6, 7, 8], *f.run(p + [5, 6, 7, 8])[:2]) for p in reversed(prompts)]
    hits = [m for _, _, m in runs]
    assert hits[0] == 12 and hits[-1] == 0, hits  # the newest prefix kept its snapshot, the oldest lost it
    for tokens, outs, m in runs:
        _check_equal_to_miss(f, tokens, outs, m)
    assert f.h.pool.inexact_hits == 0


def test_snapshot_lost_after_the_match_is_logged_and_never_republished(artifact, caplog):
    """If the matched snapshot is recycled before the forward (not seen in practice: it needs more
    publishes in between than there are rows), the hit is served from INT2 with a warning and a
    count, and that request's windows are never published as exact."""
    f = _flow(artifact)
    _, _, turn1 = f.run(range(1, 20), decode=6)
    turn2 = turn1 + [500 + i for i in range(6)]

    def lose_snapshots():
        f.h.pool.store.published.clear()

    with caplog.at_level("WARNING"):
        outs, m, _ = f.run(turn2, decode=2, before_forward=lose_snapshots)
    assert m == 24 and f.h.pool.inexact_hits == 1 and "without its window snapshot" in caplog.text
    miss, _, _ = f.run(turn2, decode=2, use_tree=False)
    assert max(rel(outs[p], miss[p]) for p in outs) > 1e-3  # INT2 prefix windows, as logged
    assert not f.h.pool.store.published  # turn 2's snapshots (28, 32) were not published
    turn3 = turn2 + [1000, 1001, 1002, 600, 601]
    outs3, m3, _ = f.run(turn3)
    assert m3 == 0  # nothing exact to resume from: recomputed, equal to a miss
    _check_equal_to_miss(f, turn3, outs3, m3)


def test_off_mode_builds_the_tree_disabled_and_refuses_a_hit(artifact):
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    f = _flow(artifact, radix="off", snapshots=0)
    assert f.tree.disable  # the hook turned SGLang's tree off at construction (logged)
    _, _, toks = f.run(range(1, 20), decode=2)
    from array import array

    from oscar_sglang.compat import adapter

    assert adapter().prefix_len(f.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", toks))))) == 0
    # a hit that reaches the backend anyway (another tree class, a plugin): one clear error, not INT2
    h = f.h
    donor = h.new_request(8)
    from harness import qkv

    q, k, v = qkv(12, 3)
    h.run(h.oscar, h.batch("extend", [donor], [0], [8]), q[:8], k[:8], v[:8])
    hit = h.new_request(12, share_from=(donor, 8))
    with pytest.raises(OscarError, match="radix-cache hit of 8 tokens .*OSCAR_SGLANG_RADIX_CACHE=off"):
        h.run(h.oscar, h.batch("extend", [hit], [8], [4]), q[8:], k[8:], v[8:])


# --------------------------------------------------------------------------- memory and settings


def test_snapshot_memory_is_counted(tmp_path, monkeypatch, topology, caplog):
    """Exact mode's snapshot rows come out of the KV budget (SGLang's configurator methods) and are in
    the pool's reported bytes."""
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator, MemoryPoolConfig

    art = tmp_path / "r128.safetensors"
    make_artifact(art, layers=3, kv_heads=2, d=128, granularity="layer")
    monkeypatch.setenv(core.ENV_ROTATIONS, str(art))
    kvc = _configurator_ns(tmp_path)
    conf = object.__new__(DefaultPoolConfigurator)
    conf.kv_cache_dtype_str = None
    cell = DefaultPoolConfigurator._compute_cell_size(conf, kvc, 3)
    budget, reqs = 64 << 20, 8
    per_slot = core.window_bytes_per_slot(conf._oscar_layout, 3)

    def tokens(mode, snaps=None):
        if mode is None:  # the default
            monkeypatch.delenv(core.ENV_RADIX, raising=False)
        else:
            monkeypatch.setenv(core.ENV_RADIX, mode)
        if snaps is None:
            monkeypatch.delenv(core.ENV_SNAPSHOTS, raising=False)
        else:
            monkeypatch.setenv(core.ENV_SNAPSHOTS, str(snaps))
        cfg = MemoryPoolConfig(max_total_num_tokens=budget // cell // 64 * 64, max_running_requests=reqs)
        return DefaultPoolConfigurator.finalize_with_max_running_requests(conf, cfg).max_total_num_tokens

    off, exact, exact5 = tokens("off"), tokens("exact"), tokens("exact", 5)
    caplog.clear()
    with caplog.at_level("INFO", logger="oscar_sglang.sglang_glue"):
        default = tokens(None)
    assert core.radix_mode() == "exact" and default == exact  # exact is the default
    # the start-up line states the snapshot budget: 2 per request slot (9 slots), in MiB and tokens
    line = next(r.getMessage() for r in caplog.records if "window snapshots" in r.getMessage())
    mib = 18 * per_slot / 2**20
    assert f"radix cache exact: 18 window snapshots (--oscar-window-snapshots) {mib:.1f} MiB" in line
    assert f"together {budget // cell // 64 * 64 - exact} tokens taken" in line and "equals a miss" in line
    slots = reqs + 1
    assert off * cell + slots * per_slot <= budget
    assert exact * cell + 3 * slots * per_slot <= budget  # default: two snapshots per request slot
    assert off - exact >= 2 * slots * per_slot // cell - 64  # the snapshots cost what they weigh
    assert exact5 * cell + (slots + 5) * per_slot <= budget and exact < exact5 < off

    monkeypatch.delenv(core.ENV_SNAPSHOTS, raising=False)
    req_pool = ReqToTokenPool(size=reqs, max_context_len=512, device="cpu", enable_memory_saver=False)
    pool = KVCacheConfigurator._build_token_to_kv_pool(
        kvc,
        sizes=type("S", (), {"max_total_num_tokens": exact})(),
        is_dsa_model=False,
        is_dsv4_model=False,
        req_to_token_pool=req_pool,
    )
    assert pool.radix == "exact" and pool.caches[0].max_seqs == 3 * slots
    pages = sum(b.numel() for b in pool.page_buffers)
    assert pool.get_kv_size_bytes() == pages + 3 * slots * per_slot
    assert pool.get_kv_size_bytes() <= budget + 3 * core.page_bytes(pool.layout)


def test_radix_settings_from_the_command_line(tmp_path, monkeypatch):
    import argparse

    from sglang.srt.server_args import ServerArgs

    art = tmp_path / "r.safetensors"
    make_artifact(art)
    for var in (core.ENV_RADIX, core.ENV_SNAPSHOTS):
        monkeypatch.delenv(var, raising=False)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    base = ["--model-path", "m", "--attention-backend", "oscar", "--oscar-rotations", str(art)]
    ns = parser.parse_args([*base, "--oscar-radix-cache", "exact", "--oscar-window-snapshots", "32"])
    import os

    try:
        ServerArgs.from_cli_args(ns)
    except Exception:  # noqa: BLE001 - the dummy model path fails later; the env is set before that
        pass
    assert os.environ[core.ENV_RADIX] == "exact" and os.environ[core.ENV_SNAPSHOTS] == "32"
    assert core.radix_mode() == "exact" and core.snapshot_count("exact", 9) == 32
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--oscar-radix-cache", "sometimes"])
    monkeypatch.setenv(core.ENV_RADIX, "sometimes")
    with pytest.raises(OscarError, match="expected one of off, exact, int2") as e:
        core.radix_mode()
    assert "\n" not in str(e.value)
    monkeypatch.setenv(core.ENV_RADIX, "exact")  # one settings object: every bad value fails it
    monkeypatch.setenv(core.ENV_SNAPSHOTS, "0")
    with pytest.raises(OscarError, match="integer >= 1"):
        core.snapshot_count("exact", 9)
    assert core.snapshot_count("off", 9) == 0 and core.snapshot_count("int2", 9) == 0
