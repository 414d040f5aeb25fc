"""oscar_kernels.serving.fold: which output projections take R_V, fingerprints across reloads."""

import logging

import pytest
import torch

from oscar_kernels.serving.fold import FoldTarget, fold_output_projections
from oscar_math.errors import OscarError

D, HQ, HKV = 8, 4, 2


class LlamaAttention(torch.nn.Module):  # the class name the engines' Llama layers carry
    def __init__(self, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.rot = torch.linalg.qr(torch.randn(HKV, D, D, generator=g, dtype=torch.float64))[0].float()
        self.o_proj = torch.nn.Linear(HQ * D, 6, bias=False)
        with torch.no_grad():
            self.o_proj.weight.copy_(torch.randn(6, HQ * D, generator=g))
        self.rotated = False


class GatedAttention(LlamaAttention):  # a class not known to feed o_proj directly
    pass


def _targets(layers):
    def serve(layer):
        return lambda on: setattr(layer, "rotated", on)

    return [
        FoldTarget(f"l{i}", m, HQ, D, lambda m=m: m.rot, m.rotated, serve(m)) for i, m in enumerate(layers)
    ]


def _same_y(layer: LlamaAttention, original: torch.Tensor) -> bool:
    """The folded weight reading o_rot gives what the original weight gives reading o_rot R_Vᵀ."""
    o_rot = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(9))
    o = torch.einsum("thgd,hed->thge", o_rot.reshape(3, HKV, HQ // HKV, D), layer.rot).reshape(3, -1)
    got = o_rot.reshape(3, -1) @ layer.o_proj.weight.detach().t()
    return torch.allclose(got, o @ original.t(), rtol=1e-5, atol=1e-5)


def test_known_layers_fold_once_and_again_after_a_reload(caplog):
    layers = [LlamaAttention(1), GatedAttention(3), LlamaAttention(5)]
    before = [m.o_proj.weight.detach().clone() for m in layers]
    with caplog.at_level(logging.INFO, logger="oscar_kernels"):
        assert fold_output_projections(_targets(layers)) == 2
    a, gated, b = layers
    assert a.rotated and b.rotated and not gated.rotated
    assert _same_y(a, before[0]) and _same_y(b, before[2])
    assert torch.equal(gated.o_proj.weight, before[1])  # refused: untouched
    assert "GatedAttention is not known to feed its attention output straight into o_proj" in caplog.text
    folded = a.o_proj.weight.detach().clone()
    assert fold_output_projections(_targets(layers)) == 2  # weights left alone: no refold
    assert torch.equal(a.o_proj.weight, folded)
    with torch.no_grad():  # a reload wrote the unfolded weight again: folded again
        a.o_proj.weight.copy_(before[0])
    fold_output_projections(_targets(layers))
    assert torch.equal(a.o_proj.weight, folded)


def test_fold_output_off_and_unfoldable_projections_keep_the_unrotation(caplog):
    layers = [LlamaAttention(1), LlamaAttention(2)]
    before = [m.o_proj.weight.detach().clone() for m in layers]
    assert fold_output_projections(_targets(layers), enabled=False) == 0
    assert not any(m.rotated for m in layers)
    assert all(torch.equal(m.o_proj.weight, w) for m, w in zip(layers, before, strict=True))
    a = layers[0]
    a.o_proj.quant_method = type("Fp8LinearMethod", (), {})()
    a.o_proj.base_layer = None
    with caplog.at_level(logging.INFO, logger="oscar_kernels"):
        assert fold_output_projections(_targets(layers)) == 1
        assert not a.rotated and "o_proj is wrapped by LoRA" in caplog.text
        del a.o_proj.base_layer
        fold_output_projections(_targets(layers))
    assert "o_proj is quantised (Fp8LinearMethod)" in caplog.text
    assert torch.equal(a.o_proj.weight, before[0])


def test_a_folded_layer_that_cannot_be_checked_any_more_is_an_error():
    """Un-rotating a layer whose weight holds R_V would be silently wrong: a folded layer whose
    projection a reload made unreadable, or the fold switched off after it folded, stops."""
    layers = [LlamaAttention(1)]
    fold_output_projections(_targets(layers))
    with pytest.raises(OscarError, match="fold_output: false"):
        fold_output_projections(_targets(layers), enabled=False)
    layers[0].o_proj.quant_method = type("CPUPackedMethod", (), {})()  # e.g. packed by the reload
    with pytest.raises(OscarError, match="cannot be checked"):
        fold_output_projections(_targets(layers))
