"""Sampler behaviour (greedy, seeds, masks, logprobs, suppression, distribution) and param validation."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from base.errors import InvalidRequestError
from engine.params import MAX_LOGPROBS, SamplingParams, StoppingParams
from engine.sampler import Sampler, TokenHistory, greedy_argmax, penalize, row_seed


def random_logits(batch: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# --- greedy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype: torch.dtype) -> None:
    logits = random_logits(8, 300, seed=1).to(dtype)
    out = Sampler(seed=0)(logits, [SamplingParams(temperature=0.0)] * 8, list(range(8)))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64


def test_greedy_ties_pick_lowest_index_and_ignore_masks_and_seed() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [7.0, 7.0, 7.0, 7.0]])
    params = [SamplingParams(temperature=0.0, top_k=1, top_p=0.1, seed=3)] * 2
    out = Sampler()(logits, params, [0, 0])
    assert out.token_ids.tolist() == [1, 0]


# --- seeds ----------------------------------------------------------------------------------------


def test_seeded_rows_do_not_depend_on_batch_composition_or_order() -> None:
    vocab = 500
    flat = random_logits(1, vocab, seed=2, scale=0.5)[0]  # flat-ish, so draws really vary
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=200, min_p=0.01, seed=1234)

    alone = [Sampler()(flat.unsqueeze(0), [params], [pos]).token_ids.item() for pos in range(24)]
    assert len(set(alone)) > 12

    others = random_logits(5, vocab, seed=3)
    other_params = [
        SamplingParams(),
        SamplingParams(seed=99, top_k=5),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.5, seed=7),
        SamplingParams(min_p=0.2),
    ]
    for pos in range(24):
        for row in (0, 3, 5):
            logits = torch.cat([others[:row], flat.unsqueeze(0), others[row:]])
            batch_params = [*other_params[:row], params, *other_params[row:]]
            positions = [pos + 17 * i for i in range(6)]
            positions[row] = pos
            out = Sampler(seed=row)(logits, batch_params, positions)
            assert out.token_ids[row].item() == alone[pos]


def test_different_seeds_and_positions_give_different_tokens() -> None:
    uniform = torch.zeros(1, 1000)
    sampler = Sampler()
    by_seed = {sampler(uniform, [SamplingParams(seed=s)], [5]).token_ids.item() for s in range(50)}
    by_position = {sampler(uniform, [SamplingParams(seed=5)], [p]).token_ids.item() for p in range(50)}
    # 50 draws from 1000 equally likely tokens: ~1 collision expected, 10 essentially impossible.
    assert len(by_seed) > 40
    assert len(by_position) > 40


def test_row_seed_is_stable() -> None:
    # Pinned so that seeded outputs stay reproducible across processes and releases.
    assert row_seed(0, 0) == row_seed(0, 0)
    assert row_seed(1, 2) != row_seed(2, 1)
    assert 0 <= row_seed(-5, 10**30) < 2**63
    assert row_seed(42, 7) == 793502930448478848


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = random_logits(16, 200, seed=4, scale=0.3)
    params = [SamplingParams()] * 16
    first = Sampler(seed=11)(logits, params, [0] * 16).token_ids
    again = Sampler(seed=11)(logits, params, [0] * 16).token_ids
    other = Sampler(seed=12)(logits, params, [0] * 16).token_ids
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


# --- masks ----------------------------------------------------------------------------------------


def allowed_tokens(logits: torch.Tensor, params: SamplingParams, slack: float = 1e-4) -> set[int]:
    """Tokens the masks could let through, computed independently in float64 with a little slack so
    that fp32 rounding at a boundary is not reported as a bug."""
    x = logits.double() / params.temperature
    allowed = torch.ones_like(x, dtype=torch.bool)
    if 0 < params.top_k < x.numel():
        kth = x.sort(descending=True).values[params.top_k - 1]
        allowed &= x >= kth
    if params.top_p < 1.0:
        kept = torch.where(allowed, x, torch.tensor(-math.inf, dtype=x.dtype))
        probs = torch.softmax(kept, dim=0)
        mass_before = 0.0
        top_p_allowed = torch.zeros_like(allowed)
        for index in probs.argsort(descending=True, stable=True).tolist():
            # Equal probabilities may come in either order, so a tie at the boundary is allowed.
            if mass_before < params.top_p + slack or probs[index] >= probs.max() - slack:
                top_p_allowed[index] = True
            mass_before += probs[index].item()
        allowed &= top_p_allowed | (probs >= min(probs[top_p_allowed]) - slack)
    if params.min_p > 0.0:
        probs = torch.softmax(torch.where(allowed, x, torch.tensor(-math.inf, dtype=x.dtype)), dim=0)
        allowed &= probs >= params.min_p * probs.max() * (1 - slack)
    return set(torch.nonzero(allowed).flatten().tolist())


@settings(max_examples=80, deadline=None)
@given(
    logits_seed=st.integers(0, 10_000),
    vocab=st.integers(2, 60),
    scale=st.sampled_from([0.1, 1.0, 5.0]),
    round_to_ties=st.booleans(),
    temperature=st.sampled_from([0.05, 0.5, 1.0, 1.7]),
    top_k=st.integers(-1, 12),
    top_p=st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.2, 0.01]),
    min_p=st.sampled_from([0.0, 0.05, 0.3, 0.9, 1.0]),
)
def test_masks_never_emit_excluded_tokens(
    logits_seed: int,
    vocab: int,
    scale: float,
    round_to_ties: bool,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
) -> None:
    logits = random_logits(1, vocab, seed=logits_seed, scale=scale)[0]
    if round_to_ties:
        logits = logits.round()
    base = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    base.validate()
    allowed = allowed_tokens(logits, base)
    draws = 48
    # Half the rows seeded, half from the shared generator; each seeded row with its own seed.
    params = [replace(base, seed=s if s % 2 else None) for s in range(draws)]
    out = Sampler(seed=logits_seed)(logits.expand(draws, vocab), params, [3] * draws)
    assert set(out.token_ids.tolist()) <= allowed


def test_top_k_one_is_the_argmax() -> None:
    logits = random_logits(32, 100, seed=5)
    params = [SamplingParams(top_k=1, seed=s) for s in range(32)]
    assert torch.equal(Sampler()(logits, params, [0] * 32).token_ids, logits.argmax(-1))


def test_mixed_rows_apply_their_own_masks() -> None:
    vocab = 50
    logits = torch.zeros(4, vocab)
    logits[:, 10] = 3.0
    logits[:, 20] = 2.9
    params = [
        SamplingParams(top_k=2, seed=1),
        SamplingParams(top_p=0.2, seed=2),  # token 10 alone holds ~23% of the mass
        SamplingParams(min_p=0.5, seed=3),
        SamplingParams(seed=4),
    ]
    seen: list[set[int]] = [set() for _ in params]
    for pos in range(60):
        for row, token in enumerate(Sampler()(logits, params, [pos] * 4).token_ids.tolist()):
            seen[row].add(token)
    assert seen[0] <= {10, 20} and seen[2] <= {10, 20}
    assert seen[1] == {10}
    assert len(seen[3] - {10, 20}) > 5  # the unmasked row does reach the other tokens


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_at_chosen_and_top_n() -> None:
    logits = random_logits(4, 120, seed=6).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.3, top_k=5, seed=1, logprobs=MAX_LOGPROBS),
        SamplingParams(temperature=2.0, top_p=0.5),
        SamplingParams(min_p=0.5, logprobs=1),
    ]
    out = Sampler(seed=0)(logits, params, [9, 9, 9, 9], suppress_token_ids=[[], [], [0, 1, 2], []])
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs.dtype == torch.float32 and out.top_logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, reference.gather(1, out.token_ids.unsqueeze(1)).squeeze(1))
    assert out.top_token_ids.shape == out.top_logprobs.shape == (4, MAX_LOGPROBS)
    assert torch.equal(out.top_token_ids[:, 0], logits.float().argmax(-1))
    assert torch.allclose(out.top_logprobs, reference.gather(1, out.top_token_ids))
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    expected_top = reference.topk(MAX_LOGPROBS, dim=-1).values
    assert torch.allclose(out.top_logprobs, expected_top)


def test_no_logprobs_requested_gives_empty_top() -> None:
    out = Sampler()(random_logits(3, 10), [SamplingParams()] * 3, [0, 1, 2])
    assert out.top_token_ids.shape == (3, 0) and out.top_logprobs.shape == (3, 0)
    assert out.logprobs.shape == (3,)


# --- suppression ----------------------------------------------------------------------------------


def test_suppressed_tokens_are_never_sampled() -> None:
    logits = torch.zeros(3, 8)
    logits[:, 2] = 10.0
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1), SamplingParams()]
    suppress = [{2}, {2, 3, 4, 5, 6, 7, 1000}, set(range(1, 8))]
    for pos in range(30):
        out = Sampler(seed=pos)(logits, params, [pos] * 3, suppress_token_ids=suppress)
        greedy, seeded, only_zero = out.token_ids.tolist()
        assert greedy == 0  # next best after suppressing 2: ties among zeros go to the lowest id
        assert seeded in {0, 1}
        assert only_zero == 0
    unsuppressed = Sampler()(logits, params, [0] * 3)
    assert unsuppressed.token_ids[0].item() == 2


def test_suppression_does_not_change_the_input_logits() -> None:
    logits = random_logits(2, 10)
    before = logits.clone()
    Sampler()(logits, [SamplingParams(temperature=0.0), SamplingParams(top_k=3)], [0, 0], [[1], [2, 3]])
    assert torch.equal(logits, before)


# --- distribution ---------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_follows_the_distribution(temperature: float) -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    draws = 20_000
    logits = probs.log().expand(draws, -1)
    out = Sampler(seed=123)(logits, [SamplingParams(temperature=temperature)] * draws, [0] * draws)
    counts = torch.bincount(out.token_ids, minlength=5).double()
    expected = torch.softmax(probs.log().double() / temperature, dim=0) * draws
    chi_square = (((counts - expected) ** 2) / expected).sum().item()
    # 4 degrees of freedom: p(chi2 > 30) ~ 5e-6; a wrong temperature gives values in the hundreds.
    assert chi_square < 30


def test_seeded_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    counts = torch.zeros(3)
    sampler = Sampler()
    for seed in range(1500):
        token = sampler(probs.log().unsqueeze(0), [SamplingParams(seed=seed)], [0]).token_ids.item()
        counts[token] += 1
    expected = probs * 1500
    assert (((counts - expected) ** 2) / expected).sum().item() < 25


# --- input checks ---------------------------------------------------------------------------------


def test_mismatched_lengths_are_rejected() -> None:
    with pytest.raises(ValueError, match="positions"):
        Sampler()(torch.zeros(2, 4), [SamplingParams()] * 2, [0])
    with pytest.raises(ValueError, match="suppress"):
        Sampler()(torch.zeros(2, 4), [SamplingParams()] * 2, [0, 0], [[1]])


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(temperature=float("nan")), "temperature"),
        (SamplingParams(temperature=float("inf")), "temperature"),
        (SamplingParams(temperature="hot"), "temperature"),  # type: ignore[arg-type]
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.5), "top_p"),
        (SamplingParams(top_k=-2), "top_k"),
        (SamplingParams(top_k=2.5), "top_k"),  # type: ignore[arg-type]
        (SamplingParams(top_k=True), "top_k"),
        (SamplingParams(min_p=-0.01), "min_p"),
        (SamplingParams(min_p=1.01), "min_p"),
        (SamplingParams(seed=1.5), "seed"),  # type: ignore[arg-type]
        (SamplingParams(logprobs=-1), "logprobs"),
        (SamplingParams(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(presence_penalty=float("nan")), "presence_penalty"),
        (SamplingParams(frequency_penalty=-2.01), "frequency_penalty"),
        (SamplingParams(frequency_penalty="high"), "frequency_penalty"),  # type: ignore[arg-type]
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(repetition_penalty=float("inf")), "repetition_penalty"),
        (SamplingParams(logit_bias={3: 100.5}), "logit_bias values"),
        (SamplingParams(logit_bias={-1: 1.0}), "logit_bias token ids"),
        (SamplingParams(logit_bias={"3": 1.0}), "logit_bias token id"),
        (SamplingParams(logit_bias={3: float("nan")}), "logit_bias value"),
        (SamplingParams(logit_bias={10: 1.0}), "logit_bias token ids must be >= 0 and < 10"),
    ],
)
def test_bad_sampling_params_name_the_field(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        params.validate(vocab_size=10)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (StoppingParams(max_tokens=0), "max_tokens"),
        (StoppingParams(max_tokens=1.5), "max_tokens"),  # type: ignore[arg-type]
        (StoppingParams(stop=("ok", "")), "stop"),
        (StoppingParams(stop=(3,)), "stop"),  # type: ignore[arg-type]
        (StoppingParams(stop_token_ids=(-1,)), "stop_token_ids"),
        (StoppingParams(stop_token_ids=("2",)), "stop_token_ids"),  # type: ignore[arg-type]
        (StoppingParams(ignore_eos="yes"), "ignore_eos"),  # type: ignore[arg-type]
        (StoppingParams(min_tokens=-1), "min_tokens"),
        (StoppingParams(max_tokens=4, min_tokens=5), "min_tokens"),
    ],
)
def test_bad_stopping_params_name_the_field(params: StoppingParams, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        params.validate()


def test_stop_token_ids_checked_against_vocab() -> None:
    StoppingParams(stop_token_ids=(9,)).validate(vocab_size=10)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        StoppingParams(stop_token_ids=(10,)).validate(vocab_size=10)


def test_good_params_validate_and_lists_become_tuples() -> None:
    SamplingParams().validate()
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, seed=-3, logprobs=MAX_LOGPROBS).validate()
    stopping = StoppingParams(max_tokens=3, stop=["a", "b"], stop_token_ids=[1, 2], min_tokens=3)
    stopping.validate()
    assert stopping.stop == ("a", "b") and stopping.stop_token_ids == (1, 2)
    assert StoppingParams(stop="END").stop == ("END",)
    hash(stopping)


def test_penalty_params_in_range_validate_and_bias_becomes_a_sorted_tuple() -> None:
    params = SamplingParams(
        presence_penalty=-2, frequency_penalty=2, repetition_penalty=1.3, logit_bias={7: -100, 2: 100}
    )
    params.validate(vocab_size=8)
    assert params.logit_bias == ((2, 100), (7, -100))
    assert params.has_penalties
    hash(params)
    assert not SamplingParams(logit_bias={1: 5.0}).has_penalties


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.7).is_greedy


# --- logit bias and penalties ---------------------------------------------------------------------


def reference_penalties(
    logits: list[float], params: SamplingParams, token_ids: list[int], num_prompt: int
) -> list[float]:
    """The OpenAI/vLLM formula, one token at a time: bias; repetition over prompt+output (divide
    positive, multiply negative); minus frequency x output count; minus presence if generated."""
    out = list(logits)
    for token_id, bias in params.logit_bias:
        out[token_id] += bias
    generated = token_ids[num_prompt:]
    for token_id in range(len(out)):
        if token_id in token_ids:
            r = params.repetition_penalty
            out[token_id] = out[token_id] / r if out[token_id] > 0 else out[token_id] * r
        count = generated.count(token_id)
        out[token_id] -= params.frequency_penalty * count
        out[token_id] -= params.presence_penalty * (1 if count else 0)
    return out


@settings(max_examples=40, deadline=None)
@given(
    presence=st.floats(-2, 2),
    frequency=st.floats(-2, 2),
    repetition=st.floats(0.2, 3.0),
    prompt=st.lists(st.integers(0, 11), min_size=1, max_size=8),
    generated=st.lists(st.integers(0, 11), max_size=10),
    bias=st.dictionaries(st.integers(0, 11), st.floats(-100, 100), max_size=3),
)
def test_penalties_match_the_reference_formula(
    presence: float, frequency: float, repetition: float, prompt: list[int], generated: list[int], bias: dict
) -> None:
    vocab = 12
    logits = random_logits(3, vocab, seed=len(prompt) + len(generated))
    params = SamplingParams(
        presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repetition, logit_bias=bias
    )
    plain = SamplingParams()
    tokens = prompt + generated
    histories = [TokenHistory([1, 2], 2), TokenHistory(tokens, len(prompt)), TokenHistory([3], 1)]
    out = penalize(logits, [plain, params, plain], histories)
    expected = reference_penalties(logits[1].tolist(), params, tokens, len(prompt))
    assert torch.allclose(out[1], torch.tensor(expected), rtol=1e-5, atol=1e-4)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])


def test_presence_and_frequency_count_only_generated_tokens() -> None:
    logits = torch.zeros(1, 5)
    history = [TokenHistory([1, 1, 2, 3, 3, 3], 3)]  # prompt 1 1 2, generated 3 3 3
    out = penalize(logits, [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], history)
    assert out[0].tolist() == [0.0, 0.0, 0.0, -0.5 - 0.75, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    out = penalize(logits, [SamplingParams(repetition_penalty=2.0)], [TokenHistory([0, 1], 1)])
    assert out[0].tolist() == [1.0, -4.0, 2.0, -2.0]


def test_penalties_change_greedy_choice_and_logit_bias_can_ban_or_force() -> None:
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    sampler = Sampler(seed=0)
    history = [TokenHistory([2, 0], 1)]  # token 0 was generated once
    greedy = SamplingParams(temperature=0.0)
    assert sampler(logits, [greedy], [2], histories=history).token_ids.item() == 0
    penalized = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    assert sampler(logits, [penalized], [2], histories=history).token_ids.item() == 1
    forced = SamplingParams(temperature=0.0, logit_bias={3: 100.0})
    assert sampler(logits, [forced], [2]).token_ids.item() == 3
    banned = SamplingParams(temperature=1.0, seed=1, logit_bias={0: -100.0, 1: -100.0})
    assert all(sampler(logits, [banned], [p]).token_ids.item() in (2, 3) for p in range(50))


def test_logprobs_stay_raw_under_penalties_and_bias() -> None:
    logits = random_logits(1, 20, seed=4)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.7, logit_bias={5: 30.0}, logprobs=2)
    out = Sampler()(logits, [params], [3], histories=[TokenHistory([1, 2, 3], 3)])
    assert out.token_ids.item() == 5
    assert out.logprobs.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 5].item(), abs=1e-6)


def test_penalized_seeded_rows_do_not_depend_on_batch_composition() -> None:
    vocab = 200
    flat = random_logits(1, vocab, seed=6, scale=0.5)
    params = SamplingParams(seed=42, presence_penalty=1.0, repetition_penalty=1.2, logit_bias={7: 3.0})
    history = TokenHistory(list(range(0, 60, 3)), 10)
    alone = Sampler()(flat, [params], [20], histories=[history]).token_ids.item()
    others = random_logits(3, vocab, seed=7)
    batch = torch.cat([others[:1], flat, others[1:]])
    batch_params = [SamplingParams(frequency_penalty=2.0), params, SamplingParams(), SamplingParams(seed=1)]
    histories = [TokenHistory([1, 2, 3], 1), history, TokenHistory([4], 1), TokenHistory([5], 1)]
    out = Sampler(seed=3)(batch, batch_params, [9, 20, 4, 7], histories=histories)
    assert out.token_ids[1].item() == alone


def test_penalties_without_histories_are_rejected() -> None:
    with pytest.raises(ValueError, match="history"):
        Sampler()(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], [0])


@pytest.mark.parametrize("vocab", [3, 255, 256, 300, 1000, 1024])
@pytest.mark.parametrize("seed", range(6))
def test_greedy_argmax_is_torch_argmax_with_ties_nans_and_a_ragged_tail(vocab: int, seed: int) -> None:
    logits = random_logits(6, vocab, seed=seed)
    if seed % 2:
        logits = logits.round()  # many ties: the first maximum must win
    logits[1, vocab - 1] = logits[1].max()  # a tie between the last column and an earlier one
    logits[2, (seed * 37) % vocab] = float("nan")  # NaN counts as the maximum, as in torch.argmax
    logits[3] = float("-inf")
    logits[4, -1] = logits[4].max() + 1.0  # the maximum in the last (possibly ragged) column
    assert torch.equal(greedy_argmax(logits), logits.argmax(-1))


def test_no_logprobs_requested_skips_them() -> None:
    logits = random_logits(3, 10)
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 3, [0, 1, 2])
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs.isnan().all()
