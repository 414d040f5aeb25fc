"""Passkey prompts: exact length, needle placement, scoring, generation through a cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from oscar_calib.needle import INSTRUCTION, NEEDLE, QUESTION, answer_key, build_needle_cases, run_needle_case
from oscar_math import OscarError


class _CharTokenizer:
    """One token per character (ids = code points mod 97), enough to test construction."""

    eos_token_id = 0
    pad_token_id = None

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": [ord(c) % 97 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(48 + int(i) % 10) for i in ids)


TEXT = "lorem ipsum dolor sit amet " * 200


@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_cases_have_exact_length_and_needle_at_depth(depth):
    tok = _CharTokenizer()
    cases = build_needle_cases(tok, TEXT, [300, 517], [depth], trials=2, seed=3)
    assert len(cases) == 4
    head = len(tok(INSTRUCTION)["input_ids"])
    for c in cases:
        assert c.input_ids.numel() == c.context
        assert len(c.key) == 5 and c.key.isdigit()
        needle = torch.tensor(tok(NEEDLE.format(key=c.key))["input_ids"])
        n_fill = c.context - head - needle.numel() - c.question.numel()
        pos = head + round(depth * n_fill)
        assert torch.equal(c.haystack[pos : pos + needle.numel()], needle)
        assert torch.equal(c.question, torch.tensor(tok(QUESTION)["input_ids"]))
    assert build_needle_cases(tok, TEXT, [300], [0.5], 2, 3)[0].key == cases[0].key  # seeded
    assert cases[0].key != cases[1].key or cases[0].haystack.tolist() != cases[1].haystack.tolist()


def test_too_short_context_is_an_error():
    with pytest.raises(OscarError, match="context"):
        build_needle_cases(_CharTokenizer(), TEXT, [100], [0.5])


def test_answer_key():
    assert answer_key(" 46044. Remember") == "46044"
    assert answer_key(" a dictionary") is None


def test_run_needle_case_through_generate():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
    )
    model = LlamaForCausalLM(cfg).eval()
    tok = _CharTokenizer()
    case = build_needle_cases(tok, TEXT, [300], [0.5], seed=1)[0]
    caches = []

    def make_cache():
        caches.append(DynamicCache())
        return caches[-1]

    ok, answer = run_needle_case(model, tok, case, make_cache, max_new_tokens=5)
    # the haystack prefilled into the cache, then the prompt's tail: the same greedy answer
    # as generating from the whole prompt at once
    with torch.no_grad():
        ref = model.generate(
            case.input_ids[None],
            attention_mask=torch.ones(1, case.context, dtype=torch.long),
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=0,
        )
    assert answer == tok.decode(ref[0, case.context :]) and len(answer) == 5
    assert len(caches) == 1 and caches[0].get_seq_length() == case.context + 5 - 1
    assert ok == (answer_key(answer) == case.key)

    class Answers(_CharTokenizer):  # scoring: whatever is generated, the decoded text decides
        def __init__(self, text):
            self.text = text

        def decode(self, ids, skip_special_tokens=True):
            return self.text

    assert run_needle_case(model, Answers(f" {case.key}. Done"), case, DynamicCache, 5) == (
        True,
        f" {case.key}. Done",
    )
    wrong = f" {int(case.key) ^ 1:05d}."
    assert run_needle_case(model, Answers(wrong), case, DynamicCache, 5) == (False, wrong)
