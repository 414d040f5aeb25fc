import json

import pytest

from oscar_math.errors import OscarError
from oscar_math.model_config import model_geometry


def test_reads_geometry_with_gqa_and_derived_head_dim(tmp_path):
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert model_geometry(str(tmp_path)) == (30, 3, 64)


def test_explicit_head_dim_and_text_config(tmp_path):
    text = {"num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 512, "head_dim": 128}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    assert model_geometry(str(tmp_path)) == (2, 8, 128)  # no num_key_value_heads: MHA


@pytest.mark.parametrize(
    "content, match",
    [
        (None, "no config.json"),
        ("{not json", "unreadable config.json"),
        ("{}", "lacks the attention geometry"),
    ],
)
def test_errors_are_one_line_and_name_the_model(tmp_path, content, match):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(OscarError, match=match) as e:
        model_geometry(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)
