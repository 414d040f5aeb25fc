"""Calibration and evaluation text: the built-in corpus, user files, the held-out split, chunks.

The built-in corpus is :data:`pydoc_data.topics.topics` (the Python reference manual's
help topics, ~465k characters, present in every CPython), joined in sorted key order. The topics
change between Python releases, patch releases included (3.12 on two machines gave different held-out
tokens), so an artifact's calibration record names the Python version; pass a text file for a corpus
that is the same everywhere.
:func:`split_text` cuts any text into a calibration part and a held-out part on
paragraph boundaries and then removes from the held-out part every paragraph that
shares a long span with the calibration part (the pydoc topics repeat whole
paragraphs), so evaluation never sees text the rotations were fitted on.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from oscar_math.errors import OscarError, check

__all__ = [
    "BUILTIN_TEXT",
    "PARAGRAPH_SEPARATOR",
    "builtin_text",
    "load_text",
    "split_text",
    "token_chunks",
    "tokenize",
]

BUILTIN_TEXT = "pydoc_data.topics"
PARAGRAPH_SEPARATOR = "\n\n"
# Held-out paragraphs sharing any span this long with the calibration text are dropped.
# Shorter than the 200 characters the tests check, so that guarantee holds with margin.
_OVERLAP_WINDOW = 128


def builtin_text() -> str:
    """The built-in corpus: every ``pydoc_data.topics`` topic, sorted by name."""
    from pydoc_data.topics import topics

    return PARAGRAPH_SEPARATOR.join(topics[key].strip() for key in sorted(topics))


def load_text(path: str | Path | None) -> str:
    """Read a corpus: ``None`` → built-in; ``.txt`` → the file; ``.jsonl`` → its ``"text"`` fields.

    JSONL documents are joined with a blank line so that :func:`split_text` can cut
    between them.

    Raises:
        OscarError: missing file, unknown suffix, malformed JSONL, empty text.
    """
    if path is None:
        return builtin_text()
    p = Path(path).expanduser()
    if not p.is_file():
        raise OscarError(f"text file '{path}' not found")
    suffix = p.suffix.lower()
    try:
        raw = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise OscarError(f"text file '{path}' is not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    if suffix == ".txt":
        text = raw
    elif suffix == ".jsonl":
        documents = []
        for lineno, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise OscarError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise OscarError(f'{path}:{lineno}: expected an object with a string "text" field')
            documents.append(record["text"].strip())
        text = PARAGRAPH_SEPARATOR.join(d for d in documents if d)
    else:
        raise OscarError(f"Invalid text file suffix: expected .txt or .jsonl, got '{p.suffix or p.name}'")
    if not text.strip():
        raise OscarError(f"text file '{path}' holds no text")
    return text


def _paragraphs(text: str) -> list[str]:
    return [p for p in (part.strip("\n") for part in text.split(PARAGRAPH_SEPARATOR)) if p.strip()]


def _window_hashes(text: str, width: int) -> set[int]:
    return {hash(text[i : i + width]) for i in range(max(len(text) - width + 1, 0))}


def _shares_span(paragraph: str, seen: set[int], width: int) -> bool:
    return any(hash(paragraph[i : i + width]) in seen for i in range(len(paragraph) - width + 1))


def split_text(text: str, heldout_fraction: float = 0.2) -> tuple[str, str]:
    """Split ``text`` into ``(calibration_text, heldout_text)`` that never overlap.

    The cut falls on the paragraph boundary nearest ``1 - heldout_fraction`` of the
    characters: paragraphs before it calibrate, paragraphs after it are held out.
    Then, until nothing changes, held-out paragraphs are dropped when the joined
    held-out text shares a span of 128 characters with the calibration text (this
    catches paragraphs repeated across topics, and spans across paragraph joins).
    Deterministic; no 128-character span of the result's held-out part occurs in its
    calibration part. Results are cached (calibration and evaluation split the same text).

    Raises:
        OscarError: a fraction outside (0, 1), or too few paragraphs to split.
    """
    check(0.0 < heldout_fraction < 1.0, "heldout_fraction", "a number in (0, 1)", heldout_fraction)
    return _split_text(text, float(heldout_fraction))


@functools.lru_cache(maxsize=4)
def _split_text(text: str, heldout_fraction: float) -> tuple[str, str]:
    paragraphs = _paragraphs(text)
    if len(paragraphs) < 2:
        raise OscarError(
            f"Invalid text: expected at least 2 paragraphs (separated by a blank line) to split, "
            f"got {len(paragraphs)}"
        )
    total = sum(len(p) for p in paragraphs)
    target = (1.0 - heldout_fraction) * total
    cut, running = 1, 0
    for i, paragraph in enumerate(paragraphs):
        if running + len(paragraph) / 2 > target:
            cut = i
            break
        running += len(paragraph)
    else:
        cut = len(paragraphs) - 1
    cut = min(max(cut, 1), len(paragraphs) - 1)
    calibration = PARAGRAPH_SEPARATOR.join(paragraphs[:cut])
    heldout_paragraphs = paragraphs[cut:]

    width = _OVERLAP_WINDOW
    seen = _window_hashes(calibration, width)
    heldout_paragraphs = [p for p in heldout_paragraphs if not _shares_span(p, seen, width)]
    # Joins of two clean paragraphs could still form a shared span: check the joined text.
    while True:
        joined = PARAGRAPH_SEPARATOR.join(heldout_paragraphs)
        bad: set[int] = set()
        start = 0
        for index, paragraph in enumerate(heldout_paragraphs):
            end = start + len(paragraph)
            if index + 1 < len(heldout_paragraphs):
                # windows that straddle this paragraph's end and the next one's start
                lo = max(start, end - width + 1)
                for i in range(lo, end + len(PARAGRAPH_SEPARATOR)):
                    if hash(joined[i : i + width]) in seen:
                        bad.update((index, index + 1))
                        break
            start = end + len(PARAGRAPH_SEPARATOR)
        if not bad:
            break
        heldout_paragraphs = [p for i, p in enumerate(heldout_paragraphs) if i not in bad]
    heldout = PARAGRAPH_SEPARATOR.join(heldout_paragraphs)
    if not heldout:
        raise OscarError("Invalid text: every held-out paragraph also occurs in the calibration part")
    return calibration, heldout


def tokenize(tokenizer: Any, text: str) -> torch.Tensor:
    """Token ids of ``text`` without special tokens: LongTensor ``[N]``."""
    encoded = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(encoded, dtype=torch.long)


def token_chunks(
    tokenizer: Any, text: str, seq_len: int, max_tokens: int, seed: int = 0
) -> list[torch.Tensor]:
    """Non-overlapping windows of ``seq_len`` tokens, at most ``max_tokens`` tokens in all.

    The token stream is cut into consecutive slots of ``seq_len``; ``max_tokens //
    seq_len`` of them (at least one) are picked with a generator seeded by ``seed`` and
    returned in text order. Same inputs and seed → same chunks.

    Returns:
        list of LongTensor ``[seq_len]``.

    Raises:
        OscarError: bad sizes, or a text shorter than one chunk.
    """
    check(isinstance(seq_len, int) and seq_len >= 2, "seq_len", "an integer >= 2", seq_len)
    check(
        isinstance(max_tokens, int) and max_tokens >= seq_len,
        "max_tokens",
        f"an integer >= seq_len ({seq_len})",
        max_tokens,
    )
    ids = tokenize(tokenizer, text)
    slots = ids.numel() // seq_len
    if slots == 0:
        raise OscarError(
            f"Invalid text: expected at least seq_len={seq_len} tokens, got {ids.numel()} tokens"
        )
    wanted = min(max_tokens // seq_len, slots)
    generator = torch.Generator().manual_seed(int(seed))
    picked = torch.randperm(slots, generator=generator)[:wanted].sort().values
    return [ids[int(s) * seq_len : (int(s) + 1) * seq_len].clone() for s in picked]
