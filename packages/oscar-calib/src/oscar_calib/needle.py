"""Passkey ("needle in a haystack") retrieval through a quantised KV cache.

A case is a prompt of exactly ``context`` tokens: an instruction, held-out filler
text with ``The pass key is NNNNN. Remember it. NNNNN is the pass key.`` inserted at
a relative ``depth``, and the question ``What is the pass key? The pass key is``.
The model answers greedily through ``model.generate`` with the scheme's cache; a case
is correct when the first number in the answer equals the key.

The haystack (everything before the question) is prefilled into the cache first;
the question and the answer then go through ``generate``, so every question and
answer token reads the haystack as the cache stores it (INT2 outside the BF16
windows) — the needle is retrieved from quantised K/V, as in a chat where a
document was cached and a question follows.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from oscar_math import check

from .text import tokenize

__all__ = [
    "NEEDLE",
    "NeedleCase",
    "build_needle_cases",
    "answer_key",
    "run_needle_case",
    "cache_kwarg",
    "INSTRUCTION",
    "QUESTION",
]

INSTRUCTION = (
    "There is an important pass key hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about the pass key.\n\n"
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class NeedleCase:
    """One passkey prompt.

    Attributes:
        context: prompt length in tokens.
        depth: relative position of the needle in the filler, in [0, 1].
        key: the 5-digit pass key.
        haystack: ``[context - q]`` token ids before the question.
        question: ``[q]`` token ids of the question.
    """

    context: int
    depth: float
    key: str
    haystack: torch.Tensor
    question: torch.Tensor

    @property
    def input_ids(self) -> torch.Tensor:
        """``[context]`` the whole prompt."""
        return torch.cat([self.haystack, self.question])


def build_needle_cases(
    tokenizer: Any,
    text: str,
    contexts: Sequence[int],
    depths: Sequence[float],
    trials: int = 1,
    seed: int = 0,
) -> list[NeedleCase]:
    """Cases for every ``(context, depth, trial)``, filler cut from ``text`` at seeded offsets.

    Raises:
        OscarError: a context too short for instruction + needle + question, or a
            text shorter than the largest context.
    """
    check(trials >= 1, "trials", "an integer >= 1", trials)
    ids = tokenize(tokenizer, text)
    head = tokenize(tokenizer, INSTRUCTION)
    question = tokenize(tokenizer, QUESTION)
    g = torch.Generator().manual_seed(seed)
    cases = []
    for context in contexts:
        for depth in depths:
            check(0.0 <= depth <= 1.0, "depth", "a value in [0, 1]", depth)
            for _ in range(trials):
                key = str(int(torch.randint(10000, 100000, (1,), generator=g)))
                needle = tokenize(tokenizer, NEEDLE.format(key=key))
                n_fill = context - head.numel() - needle.numel() - question.numel()
                check(
                    n_fill >= 16,
                    "context",
                    f">= {context - n_fill + 16} tokens for a passkey prompt",
                    context,
                )
                check(ids.numel() > n_fill, "text", f"more than {n_fill} tokens of filler", ids.numel())
                start = int(torch.randint(0, ids.numel() - n_fill, (1,), generator=g))
                fill = ids[start : start + n_fill]
                cut = int(round(depth * n_fill))
                hay = torch.cat([head, fill[:cut], needle, fill[cut:]])
                cases.append(NeedleCase(context, float(depth), key, hay, question.clone()))
    return cases


def answer_key(answer: str) -> str | None:
    """The first run of digits in ``answer`` (None if there is none)."""
    m = re.search(r"\d+", answer)
    return m.group(0) if m else None


def cache_kwarg(model: Any, cache: Any) -> dict[str, Any]:
    """``{"cache": cache}`` where transformers accepts it (>= 5.x), else ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def run_needle_case(
    model: Any,
    tokenizer: Any,
    case: NeedleCase,
    make_cache: Callable[[], Any],
    max_new_tokens: int = 8,
) -> tuple[bool, str]:
    """Prefill the haystack into ``make_cache()``, then generate the answer greedily.

    Returns:
        ``(correct, answer_text)``.
    """
    cache = make_cache()
    device = next(model.parameters()).device
    hay = case.haystack[None].to(device)
    kw = cache_kwarg(model, cache)
    with torch.no_grad():
        model(input_ids=hay, use_cache=True, **kw)
        out = model.generate(
            case.input_ids[None].to(device),
            attention_mask=torch.ones(1, case.context, dtype=torch.long, device=device),
            **kw,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id,
        )
    answer = tokenizer.decode(out[0, case.context :], skip_special_tokens=True)
    return answer_key(answer) == case.key, answer
