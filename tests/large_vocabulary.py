"""A vocabulary of SmolLM2's size (49,152 tokens) for grammar memory tests, made up but shaped like a
byte-level BPE one: every byte, lowercase words with and without a leading space, capitalized words,
numbers, and JSON punctuation with letters after it.

What a compiled grammar holds grows with the vocabulary (its token mask cache has a row of tokens per
grammar position), so memory bounds measured on the tiny tokenizer's 512 tokens say little about a
real model's; the real tokenizer is not always cached where the tests run, this is.
"""

from __future__ import annotations

import random

import xgrammar as xgr

LARGE_VOCAB_SIZE = 49152
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_PUNCTUATION = ('"', '",', '":', '{"', '"}', ', "', ' "', "\\", "\\n", "[", "]", "},", ".", "-", "_")


def _token(rng: random.Random) -> str:
    draw = rng.random()
    if draw < 0.05:
        return rng.choice(_PUNCTUATION) + _word(rng, 0, 4)
    if draw < 0.5:
        return " " + _word(rng, 1, 9)
    if draw < 0.6:
        return _word(rng, 1, 8).capitalize()
    if draw < 0.65:
        return str(rng.randint(0, 9999))
    return _word(rng, 2, 10)


def _word(rng: random.Random, shortest: int, longest: int) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(shortest, longest)))


def large_tokenizer_info(seed: int = 0) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar sees it; its last token ends a generation."""
    rng = random.Random(seed)
    tokens = [bytes([byte]) for byte in range(256)]
    seen = set(tokens)
    while len(tokens) < LARGE_VOCAB_SIZE - 1:
        token = _token(rng).encode()
        if token not in seen:
            seen.add(token)
            tokens.append(token)
    tokens.append(b"</s>")
    return xgr.TokenizerInfo(
        tokens, xgr.VocabType.RAW, vocab_size=LARGE_VOCAB_SIZE, stop_token_ids=[LARGE_VOCAB_SIZE - 1]
    )
