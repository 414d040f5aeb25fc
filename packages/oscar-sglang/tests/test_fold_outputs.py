"""oscar_sglang.core.fold_outputs: R_V into SGLang's o_proj, the pool's params switched to rotated."""

from types import SimpleNamespace as NS

import torch

from oscar_kernels import LayerQuantParams
from oscar_sglang.core import fold_outputs

D, HQ, HKV = 16, 4, 2


class LlamaAttention(torch.nn.Module):  # SGLang's Llama layer class name
    def __init__(self, layer_id: int) -> None:
        super().__init__()
        self.attn = NS(layer_id=layer_id, tp_q_head_num=HQ, head_dim=D)  # a RadixAttention's fields
        self.o_proj = torch.nn.Linear(HQ * D, 8, bias=False)
        with torch.no_grad():
            self.o_proj.weight.copy_(
                torch.randn(8, HQ * D, generator=torch.Generator().manual_seed(layer_id))
            )


def test_layers_of_the_pool_fold_and_serve_rotated_outputs(monkeypatch):
    monkeypatch.delenv("OSCAR_FOLD_OUTPUT", raising=False)
    g = torch.Generator().manual_seed(0)
    rot = torch.linalg.qr(torch.randn(HKV, D, D, generator=g, dtype=torch.float64))[0].float()
    ep = LayerQuantParams(rot, rot).expand(HKV, D, torch.device("cpu"))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([LlamaAttention(0), LlamaAttention(1), LlamaAttention(7)])
    before = [m.o_proj.weight.detach().clone() for m in model.layers]
    params = {0: ep, 1: ep}  # layer 7 is not this pool's
    assert fold_outputs(model, params) == 2
    assert params[0].rotated_output and params[1].rotated_output
    assert torch.equal(model.layers[2].o_proj.weight, before[2])
    o_rot = torch.randn(3, HQ, D, generator=g)
    o = torch.einsum("thgd,hed->thge", o_rot.reshape(3, HKV, HQ // HKV, D), rot).reshape(3, -1)
    got = o_rot.reshape(3, -1) @ model.layers[0].o_proj.weight.detach().t()
    torch.testing.assert_close(got, o @ before[0].t(), rtol=1e-5, atol=1e-5)
    # again (a weight update that left these projections alone): nothing folded twice
    folded = model.layers[0].o_proj.weight.detach().clone()
    assert fold_outputs(model, params) == 2
    assert torch.equal(model.layers[0].o_proj.weight, folded)


def test_fold_output_off_keeps_the_unrotation(monkeypatch):
    monkeypatch.setenv("OSCAR_FOLD_OUTPUT", "0")
    ep = LayerQuantParams(torch.eye(D), torch.eye(D)).expand(HKV, D, torch.device("cpu"))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([LlamaAttention(0)])
    params = {0: ep}
    assert fold_outputs(model, params) == 0 and not params[0].rotated_output
    assert fold_outputs(None, params) == 0  # a runner without a model (the tests' harness)
