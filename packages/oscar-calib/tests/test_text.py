"""Corpus loading, the calibration/held-out split and token chunking."""

from __future__ import annotations

import json
import random

import pytest
import torch

from oscar_calib.models import ByteTokenizer
from oscar_calib.text import builtin_text, load_text, split_text, token_chunks
from oscar_math.errors import OscarError


@pytest.fixture(scope="module")
def corpus() -> str:
    return builtin_text()


def test_builtin_text_is_deterministic_and_large(corpus):
    assert corpus == builtin_text()
    assert len(corpus) > 300_000
    assert load_text(None) == corpus


def test_split_is_disjoint_deterministic_and_sized(corpus):
    calibration, heldout = split_text(corpus, 0.2)
    assert (calibration, heldout) == split_text(corpus, 0.2)
    # the built-in topics repeat whole paragraphs: none of the held-out text may leak
    for start in range(0, len(heldout) - 200, 97):
        assert heldout[start : start + 200] not in calibration, start
    assert 0.12 < len(heldout) / len(corpus) < 0.22
    assert 0.75 < len(calibration) / len(corpus) < 0.85


def test_split_drops_repeated_paragraphs():
    rng = random.Random(0)
    unique = ["".join(rng.choice("abcdefgh ") for _ in range(180 + i)) for i in range(20)]
    shared = "a repeated paragraph that is long enough to matter " * 5
    text = "\n\n".join(unique[:15] + [shared] + unique[15:] + [shared])
    calibration, heldout = split_text(text, 0.3)
    assert shared.strip() in calibration
    assert shared.strip() not in heldout
    assert heldout, "unique held-out paragraphs must survive"


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_rejects_bad_fraction(fraction):
    with pytest.raises(OscarError, match="heldout_fraction"):
        split_text("a\n\nb", fraction)


def test_split_needs_two_paragraphs():
    with pytest.raises(OscarError, match="at least 2 paragraphs"):
        split_text("only one paragraph", 0.2)


def test_load_text_files(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello\n\nworld", encoding="utf-8")
    assert load_text(txt) == "hello\n\nworld"
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two", "id": 3}) + "\n")
    assert load_text(str(jsonl)) == "one\n\ntwo"


@pytest.mark.parametrize(
    "name,content,match",
    [
        ("missing.txt", None, "not found"),
        ("a.csv", "x", "expected .txt or .jsonl"),
        ("bad.jsonl", '{"text": "ok"}\n{oops\n', r"bad.jsonl:2: not valid JSON"),
        ("nofield.jsonl", '{"body": "x"}\n', 'string "text" field'),
        ("empty.txt", "  \n", "holds no text"),
    ],
)
def test_load_text_errors(tmp_path, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(OscarError, match=match):
        load_text(path)


def test_load_text_rejects_non_utf8(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes(b"caf\xe9 \xff")
    with pytest.raises(OscarError, match="not UTF-8"):
        load_text(path)


def test_token_chunks_deterministic_disjoint(corpus):
    tok = ByteTokenizer()
    text = corpus[:50_000]
    a = token_chunks(tok, text, seq_len=97, max_tokens=1000, seed=5)
    b = token_chunks(tok, text, seq_len=97, max_tokens=1000, seed=5)
    c = token_chunks(tok, text, seq_len=97, max_tokens=1000, seed=6)
    assert len(a) == 1000 // 97
    assert all(x.shape == (97,) and x.dtype == torch.long for x in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    # chunks are distinct windows of the token stream, in text order
    ids = torch.tensor(list(text.encode()))
    starts = []
    for chunk in a:
        hits = [s for s in range(0, ids.numel() - 96, 97) if torch.equal(ids[s : s + 97], chunk)]
        assert hits
        starts.append(hits[0])
    assert starts == sorted(set(starts))


def test_token_chunks_caps_at_text_length():
    chunks = token_chunks(ByteTokenizer(), "z" * 250, seq_len=100, max_tokens=10_000, seed=0)
    assert len(chunks) == 2


@pytest.mark.parametrize("seq_len,max_tokens,match", [(1, 10, "seq_len"), (10, 5, "max_tokens")])
def test_token_chunks_bad_sizes(seq_len, max_tokens, match):
    with pytest.raises(OscarError, match=match):
        token_chunks(ByteTokenizer(), "abc" * 10, seq_len, max_tokens)


def test_token_chunks_text_too_short():
    with pytest.raises(OscarError, match="at least seq_len=64 tokens, got 3"):
        token_chunks(ByteTokenizer(), "abc", 64, 128)
