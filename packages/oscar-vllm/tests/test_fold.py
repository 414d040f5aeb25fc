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


def test_the_fold_runs_after_each_weight_load_of_the_worker():
    """compat.after_weights_loaded on a stand-in for vLLM's worker: the hook runs after the first
    load and after each reload / update (not before), once however often installed; a worker
    without ``update_weights`` still gets the others; False without ``load_model``."""
    from oscar_vllm import compat

    calls = []

    class Worker:
        def load_model(self, *, load_dummy_weights=False):
            calls.append("load")

        def reload_weights(self, *a, **kw):
            calls.append("reload")

    def hook(worker):
        calls.append("fold")

    assert compat.after_weights_loaded(hook, Worker) and compat.after_weights_loaded(hook, Worker)
    w = Worker()
    w.load_model(load_dummy_weights=True)
    w.reload_weights()
    assert calls == ["load", "fold", "reload", "fold"]
    assert not compat.after_weights_loaded(hook, type("Older", (), {}))
