"""Held-out prompts: natural text every machine already has and no model here was tuned on.

Parity tests and benchmarks on a real model need prompts that are long (past a sliding window), varied,
deterministic, and not chosen to make any system look good. The Python standard library's module
docstrings are all of that and ship with every interpreter: prompt `i` is the longest run of whole
words, from the docstrings of `HELDOUT_MODULES` read from module `i` on (wrapping around), that fits a
token budget under the caller's tokenizer. The same interpreter version gives the same prompts.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Callable, Sequence
from functools import cache

# Modules whose docstrings are prose of some length (at least ~800 characters on Python 3.11), in a
# fixed order: together about 60,000 characters, so any start reaches a 4,000-token prompt.
HELDOUT_MODULES: tuple[str, ...] = (
    "re",
    "argparse",
    "json",
    "csv",
    "statistics",
    "configparser",
    "hashlib",
    "socket",
    "ssl",
    "timeit",
    "copy",
    "unittest",
    "uuid",
    "pydoc",
    "heapq",
    "inspect",
    "urllib.parse",
    "struct",
    "sched",
    "doctest",
    "subprocess",
    "os",
    "typing",
    "random",
    "sqlite3",
    "tempfile",
    "tokenize",
    "difflib",
    "collections",
    "pdb",
)

_WORD_END = re.compile(r"\S(?=\s|$)")


@cache
def module_docs() -> tuple[str, ...]:
    """The cleaned docstring of each module of `HELDOUT_MODULES`, in order."""
    return tuple(inspect.getdoc(importlib.import_module(name)) or "" for name in HELDOUT_MODULES)


def corpus(start: int = 0) -> str:
    """The docstrings from module `start` (modulo their count) on, wrapping around, blank-line separated."""
    docs = module_docs()
    first = start % len(docs)
    return "\n\n".join(docs[first:] + docs[:first])


def fit_text(text: str, max_tokens: int, count_tokens: Callable[[str], int]) -> str:
    """The longest prefix of `text` that ends a word and has at most `max_tokens` tokens.

    Binary search over word ends (a tokenizer's count grows with the prefix): about log2(words) calls.
    A budget too small for the first word still gives that word, so a prompt is never empty; raises
    ValueError for a text without words."""
    ends = [match.end() for match in _WORD_END.finditer(text)]
    if not ends:
        raise ValueError("no words in the text")
    low, high = 0, len(ends) - 1
    if count_tokens(text[: ends[high]]) <= max_tokens:
        return text[: ends[high]]
    while low < high:
        middle = (low + high + 1) // 2
        if count_tokens(text[: ends[middle]]) <= max_tokens:
            low = middle
        else:
            high = middle - 1
    return text[: ends[low]]


def heldout_prompts(lengths: Sequence[int], count_tokens: Callable[[str], int]) -> list[str]:
    """Prompt `i` of at most `lengths[i]` tokens (as `count_tokens` counts them, special tokens included
    if it adds any), starting at module `i`'s docstring. Raises ValueError if a length exceeds what the
    corpus can fill."""
    prompts = []
    for index, length in enumerate(lengths):
        text = corpus(index)
        if count_tokens(text) < length:
            raise ValueError(f"the held-out corpus has fewer than {length} tokens")
        prompts.append(fit_text(text, length, count_tokens))
    return prompts


def spread_lengths(count: int, shortest: int, longest: int) -> list[int]:
    """`count` token budgets from `shortest` to `longest`, evenly spaced on a log scale (short prompts
    are as common as long ones in real traffic, and every decade gets its share)."""
    if count == 1:
        return [longest]
    ratio = math.log(longest / shortest) / (count - 1)
    return [round(shortest * math.exp(ratio * i)) for i in range(count)]
