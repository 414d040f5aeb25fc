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


def test_the_fold_finds_the_oscar_layers_vllm_serves(caplog):
    """oscar_vllm.fold finds attention modules whose ``attn.impl`` is an OSCAR layer that stays INT2
    (an excluded layer, handed to vLLM's backend later, keeps its weight) and folds through the
    serving core (which decides per class: oscar-kernels' test_serving_fold.py)."""
    m = _model()
    before = [lay.o_proj.weight.detach().clone() for lay in m.layers]
    m.layers[2].attn.impl.serves_int2 = lambda: False  # in exclude_layers
    with caplog.at_level(logging.INFO, logger="oscar_vllm"):
        assert fold_model(m) == 1
    a, gated, excluded = m.layers
    assert a.attn.impl.rotated is True and gated.attn.impl.rotated is False
    assert excluded.attn.impl.rotated is None and torch.equal(excluded.o_proj.weight, before[2])
    assert _rotated_output_gives_the_same_y(a, before[0])
    assert "R_V folded into o_proj of 1 layer(s)" in caplog.text


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


def test_weights_from_vllms_weight_cache_are_refused_with_the_fold_on(monkeypatch):
    """Pre-processed weights (vLLM's weight cache) may hold R_V already: with fold_output on that is
    one clear error at load, never a second fold or an un-rotated read of a folded weight."""
    import pytest

    from oscar_math.errors import OscarError
    from oscar_vllm import compat, fold

    cfg = type("Cfg", (), {"additional_config": None})()
    monkeypatch.setattr(compat, "current_config", lambda: cfg)
    monkeypatch.setattr(compat, "oscar_selected", lambda c: True)
    monkeypatch.setattr(compat, "weights_pre_processed", lambda: True)
    m = _model()
    with pytest.raises(OscarError, match="fold_output"):
        fold.fold_on_load(m)
    monkeypatch.setattr(compat, "weights_pre_processed", lambda: False)
    fold.fold_on_load(m)
    assert m.layers[0].attn.impl.rotated is True
