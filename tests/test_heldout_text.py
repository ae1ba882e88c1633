"""The held-out prompt builder (`bench.heldout_text`), with a word count standing in for a tokenizer."""

from __future__ import annotations

import pytest

from bench.heldout_text import corpus, fit_text, heldout_prompts, spread_lengths


def words(text: str) -> int:
    return len(text.split())


def test_prompts_fill_their_budget_with_whole_words_from_different_starts():
    lengths = [5, 50, 500, 5000]
    prompts = heldout_prompts(lengths, words)
    assert [words(p) for p in prompts] == lengths
    for index, prompt in enumerate(prompts):
        text = corpus(index)
        assert text.startswith(prompt) and not prompt[-1].isspace()
        assert text[len(prompt)].isspace(), "a prompt ends where a word ends"
    assert len({p[:40] for p in prompts}) == len(prompts)
    assert heldout_prompts(lengths, words) == prompts


def test_fit_text_never_exceeds_the_budget_and_never_returns_nothing():
    text = "alpha beta  gamma\ndelta"
    assert fit_text(text, 3, words) == "alpha beta  gamma"
    assert fit_text(text, 10, words) == text
    assert fit_text(text, 0, words) == "alpha"
    with pytest.raises(ValueError, match="no words"):
        fit_text("  \n", 3, words)


def test_a_budget_past_the_corpus_is_refused():
    with pytest.raises(ValueError, match="fewer than"):
        heldout_prompts([words(corpus()) + 1], words)


def test_spread_lengths_runs_from_shortest_to_longest():
    lengths = spread_lengths(12, 110, 3000)
    assert lengths[0] == 110 and lengths[-1] == 3000 and lengths == sorted(set(lengths))
    assert spread_lengths(1, 10, 20) == [20]
