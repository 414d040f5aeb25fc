"""oscar_vllm.fold without vLLM: which output projections take R_V, fingerprints across reloads."""

import logging

import torch

from oscar_vllm.fold import fold_model

D, HQ, HKV = 8, 4, 2


class _Impl:
    oscar_layer = True

    def __init__(self, rot: torch.Tensor) -> None:
        self.num_heads, self.head_size, self.rot, self.rotated = HQ, D, rot, None

    def value_rotation(self) -> torch.Tensor:
        return self.rot

    def serve_rotated_output(self, on: bool) -> None:
        self.rotated = on

    def serves_int2(self) -> bool:
        return True

    @property
    def rotated_output(self) -> bool:
        return bool(self.rotated)


class _Attn(torch.nn.Module):
    def __init__(self, impl: _Impl) -> None:
        super().__init__()
        self.impl = impl


class LlamaAttention(torch.nn.Module):  # the name vLLM's Llama layers carry
    def __init__(self, rot: torch.Tensor, seed: int) -> None:
        super().__init__()
        self.attn = _Attn(_Impl(rot))
        self.o_proj = torch.nn.Linear(HQ * D, 6, bias=False)
        with torch.no_grad():
            self.o_proj.weight.copy_(torch.randn(6, HQ * D, generator=torch.Generator().manual_seed(seed)))


class GatedAttention(LlamaAttention):  # a class not known to feed o_proj directly
    pass


def _rot(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.linalg.qr(torch.randn(HKV, D, D, generator=g, dtype=torch.float64))[0].float()


def _model() -> torch.nn.Module:
    m = torch.nn.Module()
    layers = [LlamaAttention(_rot(0), 1), GatedAttention(_rot(2), 3), LlamaAttention(_rot(4), 5)]
    m.layers = torch.nn.ModuleList(layers)
    return m


def _rotated_output_gives_the_same_y(layer: LlamaAttention, original: torch.Tensor) -> bool:
    o_rot = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(9))
    rot = layer.attn.impl.rot
    o = torch.einsum("thgd,hed->thge", o_rot.reshape(3, HKV, HQ // HKV, D), rot).reshape(3, -1)
    want = o @ original.t()
    got = o_rot.reshape(3, -1) @ layer.o_proj.weight.detach().t()
    return torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_known_layers_fold_once_and_again_after_a_reload(caplog):
    m = _model()
    before = [lay.o_proj.weight.detach().clone() for lay in m.layers]
    with caplog.at_level(logging.INFO, logger="oscar_vllm"):
        assert fold_model(m) == 2
    a, gated, b = m.layers
    assert a.attn.impl.rotated is True and b.attn.impl.rotated is True and gated.attn.impl.rotated is False
    assert _rotated_output_gives_the_same_y(a, before[0]) and _rotated_output_gives_the_same_y(b, before[2])
    assert torch.equal(gated.o_proj.weight, before[1])  # refused: untouched
    assert "GatedAttention is not known to feed its attention output straight into o_proj" in caplog.text
    # a second pass (a reload that left these weights alone) folds nothing twice
    folded = a.o_proj.weight.detach().clone()
    assert fold_model(m) == 2
    assert torch.equal(a.o_proj.weight, folded)
    # a reload wrote the unfolded weight again: folded again
    with torch.no_grad():
        a.o_proj.weight.copy_(before[0])
    fold_model(m)
    assert torch.equal(a.o_proj.weight, folded)


def test_fold_output_off_and_unfoldable_projections_keep_the_unrotation(caplog):
    m = _model()
    before = [lay.o_proj.weight.detach().clone() for lay in m.layers]
    assert fold_model(m, enabled=False) == 0
    assert all(lay.attn.impl.rotated is False for lay in m.layers)
    assert all(torch.equal(lay.o_proj.weight, w) for lay, w in zip(m.layers, before, strict=True))
    a = m.layers[0]
    a.o_proj.quant_method = type("Fp8LinearMethod", (), {})()
    a.o_proj.base_layer = None
    with caplog.at_level(logging.INFO, logger="oscar_vllm"):
        assert fold_model(m) == 1
    assert a.attn.impl.rotated is False and "o_proj is wrapped by LoRA" in caplog.text
    del a.o_proj.base_layer
    with caplog.at_level(logging.INFO, logger="oscar_vllm"):
        fold_model(m)
    assert "o_proj is quantised (Fp8LinearMethod)" in caplog.text
    assert torch.equal(a.o_proj.weight, before[0])


def test_the_fold_runs_before_weight_processing_and_after_each_reload(monkeypatch):
    """compat.before_weight_processing wraps the loaders' process_weights_after_loading (the model
    is folded before vLLM packs or quantises its weights), once however often installed;
    compat.after_weights_reloaded runs after a worker's reload_weights / update_weights."""
    import types

    from oscar_vllm import compat

    calls = []
    loader = types.ModuleType("fake_loader")

    def process_weights_after_loading(model, model_config, target_device):
        calls.append(("process", model))

    loader.process_weights_after_loading = process_weights_after_loading
    monkeypatch.setitem(__import__("sys").modules, "fake_loader", loader)
    monkeypatch.setattr(compat, "_WEIGHT_PROCESSING_CALLERS", ("fake_loader", "no_such_loader"))
    hook = lambda model: calls.append(("fold", model))  # noqa: E731
    assert compat.before_weight_processing(hook) and compat.before_weight_processing(hook)
    loader.process_weights_after_loading("m", None, None)
    assert calls == [("fold", "m"), ("process", "m")]

    class Worker:
        def reload_weights(self, *a, **kw):
            calls.append("reload")

    calls.clear()
    assert compat.after_weights_reloaded(lambda w: calls.append("refold"), Worker)
    Worker().reload_weights()
    assert calls == ["reload", "refold"]
    assert not compat.after_weights_reloaded(hook, type("Older", (), {}))


def test_a_folded_layer_that_cannot_be_checked_after_a_reload_stops_the_engine():
    import pytest

    from oscar_math.errors import OscarError

    m = _model()
    fold_model(m)
    a = m.layers[0]
    a.o_proj.quant_method = type("CPUPackedMethod", (), {})()  # e.g. packed after the reload
    with pytest.raises(OscarError, match="fold_output: false"):
        fold_model(m, reload=True)
