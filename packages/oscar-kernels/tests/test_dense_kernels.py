"""The start-up check of dense prefill kernels (``dense_kernels``): the reference passes it, each
way a third party's kernel could break the contract is refused with its reason, and torch's own
FlashAttention passes it on a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import HAS_CUDA

from oscar_kernels import (
    check_dense_attention,
    dense_attention_ref,
    pick_dense_attention,
    torch_flash_attention,
)
from oscar_kernels.dense_kernels import _lse_rows


def _shifted_window(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):  # noqa: ANN001, ANN202
    return dense_attention_ref(
        q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left + 1 if window_left >= 0 else -1
    )


def _transposed_lse(*args):  # noqa: ANN002, ANN202
    out, lse = dense_attention_ref(*args)
    return out, lse.t().contiguous()


def _no_key_rows_minus_inf(*args):  # noqa: ANN002, ANN202
    out, lse = dense_attention_ref(*args)
    return out, torch.where(torch.isinf(lse), torch.full_like(lse, float("-inf")), lse)


def _no_key_rows_zero_lse(*args):  # noqa: ANN002, ANN202
    out, lse = dense_attention_ref(*args)
    return out, torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _ignores_scale(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_left):  # noqa: ANN001, ANN202
    return dense_attention_ref(q, k, v, cu_q, cu_k, max_q, max_k, 1.0, window_left)


def _lse_base_two(*args):  # noqa: ANN002, ANN202
    out, lse = dense_attention_ref(*args)
    return out, lse / 0.6931471805599453


def _unsupported(*args):  # noqa: ANN002, ANN202
    raise RuntimeError("FlashAttention only supports head dimension at most 256\nmore detail")


def test_the_reference_passes_the_check():
    assert check_dense_attention(dense_attention_ref, "cpu", head_dim=64) is None
    # -inf instead of FlashAttention's +inf for a row without keys: the merge takes either
    assert check_dense_attention(_no_key_rows_minus_inf, "cpu", head_dim=64) is None
    assert check_dense_attention(dense_attention_ref, "cpu", head_dim=32, kv_heads=1, group=4) is None


def test_the_check_runs_under_an_engines_default_device_and_dtype():
    """vLLM builds its layers (which pick the kernel) under ``with torch.device("cuda")`` and a bf16
    default dtype: the probe must not make tensors on the default device (here: meta)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            assert check_dense_attention(dense_attention_ref, "cpu", head_dim=64) is None
    finally:
        torch.set_default_dtype(old)


def test_a_check_that_raises_is_a_refusal_not_a_failed_start():
    def bad_shape(q, *args):  # noqa: ANN001, ANN002, ANN202
        return q[:0], None  # the check's own comparison raises on this

    name, attn, refusals = pick_dense_attention([("odd", lambda: bad_shape)], "cpu", head_dim=64)
    assert name is None and attn is None and len(refusals) == 1 and refusals[0].startswith("odd: ")


@pytest.mark.parametrize(
    ("kernel", "says"),
    [
        (_shifted_window, "window_left=3: output differs"),
        (_transposed_lse, "shapes"),
        (_no_key_rows_zero_lse, "infinite LSE"),
        (_ignores_scale, "output differs"),
        (_lse_base_two, "LSE differs"),
        (_unsupported, "RuntimeError: FlashAttention only supports head dimension at most 256"),
    ],
)
def test_a_kernel_breaking_the_contract_is_refused_with_its_reason(kernel, says):
    why = check_dense_attention(kernel, "cpu", head_dim=64)
    assert why is not None and says in why, why
    assert "\n" not in why  # one line for the start-up log


def test_a_padded_lse_is_unpacked_to_rows():
    """FlashAttention builds before 2.4 give varlen LSEs as ``[B, H, max_q]``."""
    cu_q = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    rows = torch.randn(5, 7)
    padded = torch.full((3, 5, 4), float("nan"))
    for b in range(3):
        n = int(cu_q[b + 1] - cu_q[b])
        padded[b, :, :n] = rows[:, int(cu_q[b]) : int(cu_q[b + 1])]
    assert torch.equal(_lse_rows(padded, cu_q, 7), rows)
    assert _lse_rows(rows, cu_q, 7) is not None and torch.equal(_lse_rows(rows, cu_q, 7), rows)


def test_pick_takes_the_first_kernel_that_passes_and_says_why_others_did_not():
    def missing():  # noqa: ANN202
        raise ImportError("No module named 'sgl_kernel'")

    name, attn, refusals = pick_dense_attention(
        [("missing", missing), ("none", lambda: None), ("broken", lambda: _ignores_scale),
         ("ref", lambda: dense_attention_ref), ("never asked", missing)],
        "cpu", head_dim=64,
    )  # fmt: skip
    assert name == "ref" and attn is dense_attention_ref
    assert [r.split(":")[0] for r in refusals] == ["missing", "none", "broken"]
    assert "ImportError: No module named 'sgl_kernel'" in refusals[0]
    name, attn, refusals = pick_dense_attention([("broken", lambda: _ignores_scale)], "cpu", head_dim=64)
    assert name is None and attn is None and len(refusals) == 1


@pytest.mark.skipif(not HAS_CUDA, reason="torch's FlashAttention runs on CUDA only")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_torch_flash_attention_passes_the_check_on_the_gpu(head_dim):
    assert check_dense_attention(torch_flash_attention(), "cuda", head_dim=head_dim) is None
    assert (
        check_dense_attention(torch_flash_attention(), "cuda", head_dim=head_dim, kv_heads=1, group=4) is None
    )


def test_the_serving_core_checks_once_per_geometry_and_logs_its_choice(caplog):
    import logging

    from oscar_kernels.serving import dense as serving_dense

    made = []

    def factory():  # noqa: ANN202
        made.append(1)
        return dense_attention_ref

    serving_dense._CHOSEN.clear()
    cands = [("broken", lambda: _ignores_scale), ("the reference", factory)]
    with caplog.at_level(logging.INFO, logger="oscar_kernels"):
        first = serving_dense.prefill_kernel(cands, "cpu", 64, 2, 2)
        again = serving_dense.prefill_kernel(cands, "cpu", 64, 2, 2)  # every further layer
    assert first is dense_attention_ref and again is first and len(made) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "through the reference" in lines[0] and "broken: window_left=-1" in lines[0]
    with caplog.at_level(logging.INFO, logger="oscar_kernels"):
        none = serving_dense.prefill_kernel([("broken", lambda: _ignores_scale)], "cpu", 64, 2, 2)
    assert none is None and "Triton extend kernel" in caplog.records[-1].getMessage()
    serving_dense._CHOSEN.clear()
