"""Mask-fill budgets: a constrained request's fills are bounded per token (its choices together), it ends
alone with its own error past the bound, and a grammar steep on a probe is refused before it runs.

Every decision here is made on a clock the test drives (each fill "takes" what the test says), so no
assertion depends on how fast this machine fills a mask; the real ambiguous grammars appear only where
the outcome is the same at any speed.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import xgrammar as xgr
from conftest import engine_for, random_prompts, tiny_hf_model
from test_decode_scheduler import Harness
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE

from decode_service.engine_core.fill_vetting import PROBE_SHARE, PROBE_TOKENS, FillCostError, vet_fill_cost
from decode_service.engine_core.request import ServedRequest
from engine.grammar import GrammarMask, GrammarState
from engine.grammar_budget import FillBudget, GrammarFillTimeoutError, probe_fill_times, token_byte_lengths
from engine.params import SamplingParams, StoppingParams
from engine.sequence import FinishReason
from engine.utf8_tokens import Utf8Tokens
from serving.status import status_for

FIELD = "structured_output.grammar"
LETTERS = "[a-z]+"


class FillClock:
    """A clock on which every fill takes `cost` seconds: it moves by `cost` each time it is read, and a
    fill is timed by two reads."""

    def __init__(self, cost: float) -> None:
        self.cost = cost
        self.now = 0.0

    def __call__(self) -> float:
        self.now += self.cost
        return self.now


@pytest.fixture(scope="module")
def utf8(tiny_xgr_info) -> Utf8Tokens:
    return Utf8Tokens.of(tiny_xgr_info)


@pytest.fixture(scope="module")
def letters(tiny_xgr_compiler) -> xgr.CompiledGrammar:
    return tiny_xgr_compiler.compile_regex(LETTERS)


def state(compiled, utf8, budget=None) -> GrammarState:
    return GrammarState(compiled, utf8=utf8, budget=budget, source=("regex", LETTERS))


def row_allows_everything(mask: GrammarMask, row: int) -> bool:
    return bool((mask.bitmask[row] == -1).all())


# -- the bound in the step's mask ---------------------------------------------------------------------------


def test_a_requests_choices_share_one_bound_per_token(letters, utf8):
    """Three choices at 0.4 s a fill pass a 1 s bound on the third row: the fourth is not filled, every
    choice ends at its accept with the error naming the field, and another request's rows are untouched."""
    greedy = FillBudget(1.0, FIELD, FillClock(0.4))
    first = state(letters, utf8, greedy)
    choices = [first, *(first.fork() for _ in range(3))]
    other = state(letters, utf8, FillBudget(1.0, "response_format", FillClock(0.4)))
    mask = GrammarMask.fill([choices[0], other, *choices[1:]], TINY_VOCAB_SIZE)
    assert mask is not None and mask.rows == [0, 1, 2, 3, 4]
    assert not row_allows_everything(mask, 3), "the third choice was filled"
    assert row_allows_everything(mask, 4), "the fourth choice was not filled"
    error = greedy.exceeded
    assert isinstance(error, GrammarFillTimeoutError)
    assert error.field == FIELD and "1200 ms" in str(error) and "its 3 choices together" in str(error)
    code, message = status_for(error)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message.startswith(f"{FIELD}: ")
    assert "--structured-output-fill-timeout-ms" in message
    letter = utf8_letter_token(mask, 1)
    for choice in choices:
        with pytest.raises(GrammarFillTimeoutError):
            choice.accept(letter)
    other.accept(letter)
    assert other.budget.exceeded is None


def test_the_bound_is_per_token_not_per_request(letters, utf8):
    budget = FillBudget(1.0, FIELD, FillClock(0.4))
    choices = [state(letters, utf8, budget)]
    choices.append(choices[0].fork())
    for _ in range(20):  # 0.8 s a token, 16 s in all
        mask = GrammarMask.fill(choices, TINY_VOCAB_SIZE)
        letter = utf8_letter_token(mask, 0)
        for choice in choices:
            choice.accept(letter)
    assert budget.exceeded is None


def test_an_exceeded_request_is_not_filled_again(letters, utf8):
    budget = FillBudget(0.1, FIELD, FillClock(0.4))
    grammar = state(letters, utf8, budget)
    GrammarMask.fill([grammar], TINY_VOCAB_SIZE)
    assert budget.exceeded is not None and "one choice" in str(budget.exceeded)
    clock = budget.clock
    read = clock.now
    mask = GrammarMask.fill([grammar, grammar.fork()], TINY_VOCAB_SIZE)
    assert clock.now == read, "nothing was timed, so nothing was filled"
    assert row_allows_everything(mask, 0) and row_allows_everything(mask, 1)


def utf8_letter_token(mask: GrammarMask, row: int) -> int:
    """A token other than EOS that row `row` of `mask` allows (the lowest id), to advance states with."""
    allowed = np.unpackbits(mask.bitmask[row].numpy().view(np.uint8), bitorder="little")[:TINY_VOCAB_SIZE]
    return next(int(i) for i in np.flatnonzero(allowed) if i not in TINY_EOS_TOKEN_IDS)


# -- the bound in the serving loop --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(5, vocab_size=TINY_VOCAB_SIZE)


def constrained(engine, compiled, utf8, request_id, budget, n=1, max_tokens=24) -> ServedRequest:
    seq = engine.make_sequence(
        [5, 6, 7],
        SamplingParams(temperature=1.0, seed=4),
        StoppingParams(max_tokens=max_tokens),
        request_id,
        grammar=state(compiled, utf8, budget),
    )
    return ServedRequest(seq, n=n)


def test_a_request_past_its_bound_ends_alone_and_the_batch_goes_on(
    hf_model, tiny_tokenizer, tiny_xgr_compiler, utf8
):
    """n = 3 at 0.4 s a fill: the prefill's one row fits 1 s, the first decode step's three rows do not.
    The request ends with its error and holds nothing; a constrained request within its bound, and plain
    ones, complete."""
    engine = engine_for(hf_model, tokenizer=tiny_tokenizer)
    harness = Harness(engine)
    for i, prompt in enumerate(random_prompts(3, 12, min_len=3, max_len=9, vocab=TINY_VOCAB_SIZE)):
        harness.submit(f"free-{i}", prompt, max_tokens=16)
    letters = tiny_xgr_compiler.compile_regex("[a-z]{1,40}")
    bad = constrained(engine, letters, utf8, "bad", FillBudget(1.0, FIELD, FillClock(0.4)), n=3)
    fine = constrained(engine, letters, utf8, "fine", FillBudget(1.0, FIELD, FillClock(0.3)), n=3)
    harness.loop.submit(bad)
    harness.loop.submit(fine)
    harness.run()
    error = harness.errors.pop("bad")
    assert isinstance(error, GrammarFillTimeoutError) and "its 3 choices together" in str(error)
    assert harness.tokens["bad"] and len(harness.tokens["bad"]) == 1, "only the prefill's token came"
    assert not harness.errors, harness.errors
    assert harness.finish["fine"] in (FinishReason.STOP, FinishReason.LENGTH)
    for i in range(3):
        assert harness.finish[f"free-{i}"] is FinishReason.LENGTH and len(harness.tokens[f"free-{i}"]) == 16
    assert engine.num_free_blocks == engine.num_blocks


# -- the probe before admission -----------------------------------------------------------------------------


def test_the_probe_follows_the_longest_allowed_token_until_the_grammar_can_only_end(
    tiny_xgr_compiler, utf8, tiny_xgr_info
):
    compiled = tiny_xgr_compiler.compile_regex("[a-z]{30}")
    lengths = token_byte_lengths(tiny_xgr_info.decoded_vocab)
    probe = GrammarState(compiled, utf8=utf8)
    times = probe_fill_times(probe, lengths, PROBE_TOKENS, 1.0, FillClock(0.001))
    assert times == pytest.approx([0.001] * len(times))
    longest = int(
        lengths[[i for i in range(TINY_VOCAB_SIZE) if tiny_xgr_info.decoded_vocab[i].isalpha()]].max()
    )
    assert len(times) - 1 <= -(-30 // longest) + 1 < 30, "long tokens, not letter by letter"
    assert allowed_ids(probe) <= set(TINY_EOS_TOKEN_IDS), "it stopped where only the end is left"


def allowed_ids(grammar: GrammarState) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, TINY_VOCAB_SIZE)
    grammar.fill(bitmask, 0)
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:TINY_VOCAB_SIZE]
    return {int(i) for i in np.flatnonzero(bits)}


def test_the_probe_stops_at_the_first_fill_past_its_threshold(letters, utf8, tiny_xgr_info):
    lengths = token_byte_lengths(tiny_xgr_info.decoded_vocab)
    times = probe_fill_times(state(letters, utf8), lengths, PROBE_TOKENS, 0.25, FillClock(0.3))
    assert times == pytest.approx([0.3])


def test_a_grammar_steep_on_the_probe_is_refused_naming_its_field(letters, utf8):
    limit = 1.0
    with pytest.raises(FillCostError) as caught:
        vet_fill_cost(state(letters, utf8), FIELD, limit, FillClock(limit / PROBE_SHARE * 1.01))
    assert caught.value.field == FIELD
    code, message = status_for(caught.value)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and message.startswith(f"{FIELD}: ")
    assert "after 0 tokens of a trial answer" in message and "--structured-output-fill-timeout-ms" in message
    vet_fill_cost(state(letters, utf8), FIELD, limit, FillClock(limit / PROBE_SHARE * 0.99))


def test_the_probe_leaves_the_state_it_was_given_alone(letters, utf8):
    grammar = state(letters, utf8)
    vet_fill_cost(grammar, FIELD, 1.0, FillClock(1e-6))
    assert allowed_ids(grammar) == allowed_ids(state(letters, utf8)), "still at the grammar's start"
