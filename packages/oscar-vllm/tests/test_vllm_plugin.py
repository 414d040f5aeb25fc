import importlib.util

import pytest

from oscar_math.plugin_checks import contract_tests

ENGINE_PRESENT = importlib.util.find_spec("vllm") is not None

# the plugin contract (oscar_math.plugin_checks): names its engine without importing it, listed
test_plugin_module, test_engine_listed = contract_tests("vllm", "oscar-vllm", "oscar_vllm.plugin")


def _api_check():
    import sys
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "api_check.py"
    spec = importlib.util.spec_from_file_location("oscar_vllm_api_check", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not ENGINE_PRESENT, reason="vLLM is not installed (run the nox session 'vllm')")
def test_api_check_passes_on_the_installed_vllm(monkeypatch, capsys):
    # the same script checks another release's sources statically (docs/vllm.md: the 0.33.0 audit)
    mod = _api_check()
    assert mod.main() == 0, capsys.readouterr().out
    # it can fail: an engine core whose KV-cache init changed signature is reported
    from vllm.v1.engine import core

    monkeypatch.setattr(core.EngineCore, "_initialize_kv_caches", lambda self, vllm_config, extra: None)
    assert mod.main() == 1
    assert "FAIL  check_config_and_engine" in capsys.readouterr().out


@pytest.mark.skipif(not ENGINE_PRESENT, reason="vLLM is not installed (run the nox session 'vllm')")
def test_cudagraph_support_is_decode_only_without_prefix_caching_and_none_with_it():
    """vLLM captures FULL graphs only for batches every builder supports: OSCAR's builder answers
    UNIFORM_SINGLE_TOKEN_DECODE with caching off and NEVER with exact prefix caching (host logic
    per row) on the V1 runner; the window layers' builder answers the same."""
    from types import SimpleNamespace

    from vllm.v1.attention.backend import AttentionCGSupport

    from oscar_vllm import backend, compat

    def cfg(caching: bool, hybrid: bool = True, v2: bool = False):
        return SimpleNamespace(
            attention_config=SimpleNamespace(backend=SimpleNamespace(name="OSCAR")),
            cache_config=SimpleNamespace(enable_prefix_caching=caching),
            scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not hybrid),
            additional_config={"oscar": {"rotations": "x.safetensors"}},
            use_v2_model_runner=v2,
        )

    get = backend.OscarMetadataBuilder.get_cudagraph_support
    assert get(cfg(False), None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert get(cfg(True), None) == AttentionCGSupport.NEVER
    # caching requested but not served exactly (no hybrid manager: the guard turns it off)
    assert get(cfg(True, hybrid=False), None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    assert backend.OscarWindowBuilder.get_cudagraph_support(cfg(True), None) == AttentionCGSupport.NEVER
    # vLLM's V2 runner (its default on GPUs): the restores run in the builders, so pure decode
    # batches replay FULL graphs with caching on too — and vLLM takes the lowest answer over every
    # KV-cache group, so the window groups' builder must give the same (its default is NEVER: the
    # first H200 run fell back to piecewise graphs for that reason)
    for builder in (backend.OscarMetadataBuilder, backend.OscarWindowBuilder):
        got = builder.get_cudagraph_support(cfg(True, v2=True), None)
        assert got == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, builder
    assert compat.cudagraph_support(cfg(False)) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_window_record_plan_for_the_engines_geometries():
    """The window-record geometry plan_window_records picks (docs/vllm.md, "Prefix caching")."""
    from oscar_kernels.serving import plan_window_records

    # SmolLM2 on CPU: block 128, INT2 page 15,360 B = 120 BF16 rows of d 64, 64 tokens in flight
    p = plan_window_records(3, 128, 64, 256, 120, 64)
    assert (p.block_size, p.sink_parts, p.sink_part, p.groups) == (16, 16, 4, 1)
    assert p.record_rows(3) == 120
    # Qwen3-8B shape on GPU: block 16, 8 KV heads of 128, group 128 -> 72 B cells, 36 rows a page
    p = plan_window_records(8, 16, 64, 256, 8 * 16 * 72 // 256, 2048)
    assert (p.block_size, p.sink_parts, p.sink_part, p.groups) == (16, 16, 4, 9)


def test_step_exchange_runs_each_layers_restores_once_when_every_window_table_arrived(monkeypatch):
    """With prefix caching the window groups' builders run the step's restores before the model
    (backend._StepExchange): once every window group's table is in, for every prepared layer, once;
    not for a CUDA-graph capture's dummy step; and a window table for a step the INT2 builder did not
    plan first is an error, never a skipped restore."""
    from types import SimpleNamespace

    import torch

    from oscar_kernels.serving import StepPlan
    from oscar_math.errors import OscarError
    from oscar_vllm import backend

    calls = []

    def restore_rows(cache, pages, tables, restore, memo):  # one call per layer: every row of it
        calls.extend((cache, slot, prefix, tables[:, row].tolist()) for row, slot, prefix in restore)

    monkeypatch.setattr(backend, "restore_window_rows", restore_rows)

    def impl(name):
        i = backend.OscarAttentionImpl.__new__(backend.OscarAttentionImpl)
        i.window_names, i._cache, i._pages = (
            [f"{name}.oscar_window_0", f"{name}.oscar_window_1"],
            name,
            "pages",
        )
        return i

    layers = [impl("l0"), impl("l1")]
    unprepared = impl("l2")
    unprepared._cache = None  # no forward ran yet: it restores in its own forward
    ctx = {f"l{i}": SimpleNamespace(impl=x) for i, x in enumerate([*layers, unprepared])}
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))
    ex = backend._exchange(cfg)
    assert backend._exchange(cfg) is ex and ex.groups == 2

    def md(restore):
        z = torch.zeros(2, dtype=torch.int32)
        return StepPlan(2, 1, z, z, z, z, z, z, z, z, True, restore=restore)

    step = md(((1, 5, 300),))
    ex.plan(step)
    ex.table(0, torch.tensor([[1, 2], [3, 4]]))
    assert calls == []  # window group 1's table is not in yet
    view = ex.table(1, torch.tensor([[5, 6], [7, 8]]))
    assert calls == [("l0", 5, 300, [[3, 4], [7, 8]]), ("l1", 5, 300, [[3, 4], [7, 8]])]
    # one buffer holds both groups' tables (the layers read a view of it, no stack a layer)
    assert ex.stacked.tolist() == [[[1, 2], [3, 4]], [[5, 6], [7, 8]]]
    assert view.data_ptr() == ex.stacked[1].data_ptr()
    buf = ex.stacked
    ex.stage(0, torch.tensor([[9, 9]]))  # a capture's dummy row: the same buffer, row 0 of group 0
    assert ex.stacked is buf and ex.stacked[0].tolist() == [[9, 9], [3, 4]]
    assert step.restored_by == {id(layers[0]), id(layers[1])}  # l2 restores in its forward
    calls.clear()
    ex.plan(md(()))  # a step without restores
    ex.table(0, torch.zeros(2, 2, dtype=torch.int32))
    ex.table(1, torch.zeros(2, 2, dtype=torch.int32))
    assert calls == []
    with pytest.raises(OscarError, match="window group 0"):
        ex.table(0, torch.zeros(2, 2, dtype=torch.int32))  # no INT2 plan for this step


@pytest.mark.skipif(not ENGINE_PRESENT, reason="vLLM is not installed (run the nox session 'vllm')")
def test_a_decode_pass_stays_open_past_its_layer_only_inside_a_capture_and_not_in_the_last_layer(
    monkeypatch,
):
    """backend.join_later: a layer leaves its INT2 pass for the next layer only in a FULL graph's
    capture of a decode step, and never in the step's last layer (a capture must end joined) — the
    last by decoder index, not by name."""
    import torch

    from oscar_kernels.serving import plan_step
    from oscar_vllm import backend

    names = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 9, 10, 11)]
    assert backend.last_layer_of(list(reversed(names))) == names[-1]
    assert backend.last_layer_of([]) == ""
    qsl = torch.arange(3, dtype=torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    table = torch.tensor([[0], [1]], dtype=torch.int32)
    md = plan_step(qsl, qsl, lens, lens, table, torch.tensor([4, 24]), 2, torch.arange(2), None)
    assert md.all_decode
    md.last_layer = names[-1]
    assert not backend.join_later(md, names[3])  # not capturing (eager, piecewise)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert backend.join_later(md, names[3])
    assert backend.join_later(md, names[4])  # layers.10 < layers.11
    assert not backend.join_later(md, names[-1])
    md.last_layer = ""  # a builder that knows no last layer: every layer joins its own
    assert not backend.join_later(md, names[3])
    md.last_layer = names[-1]
    md.all_decode = False
    assert not backend.join_later(md, names[3])
