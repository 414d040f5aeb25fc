"""The worked example of docs/format.md ("INT2 encoding"), number for number: a third party
implementing the format from the page alone must get these bytes and this read-back."""

import torch

from oscar_math import dequantize_int2, quantize_int2, unpack_int2


def test_the_documented_key_row_encodes_and_reads_back_as_written():
    x = torch.tensor([[0.9, -1.3, 0.2, 2.1, -0.4, 0.0, 1.6, -2.2]])
    q = quantize_int2(x, group_size=8, clip_ratio=0.9)
    # bf16(lo) and bf16((hi - lo) / 3), rounded to nearest before the codes
    assert q.zero.dtype == torch.bfloat16 and q.scale.dtype == torch.bfloat16
    assert q.zero.float().item() == -1.9765625
    assert q.scale.float().item() == 1.2890625
    assert unpack_int2(q.codes).tolist() == [[2, 1, 2, 3, 1, 2, 3, 0]]
    # strided packing: byte b holds codes b, b + d/4, b + d/2, b + 3d/4 at bits 0, 2, 4, 6
    assert q.codes.tolist() == [[218, 45]]
    want = [0.6015625, -0.6875, 0.6015625, 1.890625, -0.6875, 0.6015625, 1.890625, -1.9765625]
    assert dequantize_int2(q).tolist() == [want]
