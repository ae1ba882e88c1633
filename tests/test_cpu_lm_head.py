"""The CPU LM head: `greedy_lm_head` returns exactly torch's argmax of the logits (ties, NaN, every
slice boundary), the module computes the logits nn.Linear does, and the engine takes the no-logits
path only when the sampler would return the argmax and nothing else."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_for, tiny_hf_model
from torch import nn

from engine.model_runner import ScheduledChunk
from engine.params import SamplingParams, StoppingParams
from engine.sampler import argmax_suffices
from kernels import cpu_linear, cpu_lm_head

SLICE = 2048  # lm_head.cpp's vocabulary slice; the shapes below straddle it


@pytest.fixture(params=["avx512", "portable"])
def isa(request, extension):
    before = extension.gemv_isa()
    try:
        extension.set_gemv_isa(request.param)
    except RuntimeError:
        pytest.skip(f"this CPU cannot run {request.param}")
    yield request.param
    extension.set_gemv_isa(before)


def greedy(extension, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return extension.greedy_lm_head(x, weight, weight.t().contiguous(), cpu_linear.GEMV_MAX_ROWS)


@pytest.mark.parametrize("rows", [1, 3, cpu_linear.GEMV_MAX_ROWS, cpu_linear.GEMV_MAX_ROWS + 1, 70])
@pytest.mark.parametrize("vocab", [5, SLICE - 1, SLICE, 2 * SLICE + 17])
def test_matches_torch_argmax(extension, isa, rows, vocab):
    torch.manual_seed(rows * vocab)
    x, weight = torch.randn(rows, 40), torch.randn(vocab, 40)
    assert torch.equal(greedy(extension, x, weight), (x @ weight.t()).argmax(dim=-1))


@pytest.mark.parametrize("rows", [2, 40])
def test_ties_go_to_the_lowest_index_within_and_across_slices(extension, isa, rows):
    weight = torch.zeros(3 * SLICE, 8)
    for index in (SLICE + 5, 17, 33, 2 * SLICE):
        weight[index] = 1.0
    x = torch.ones(rows, 8)
    assert greedy(extension, x, weight).tolist() == [17] * rows


@pytest.mark.parametrize("rows", [2, 40])
def test_nan_counts_as_the_maximum_and_the_first_nan_wins(extension, isa, rows):
    torch.manual_seed(0)
    weight = torch.randn(3 * SLICE, 8)
    weight[5] = 1e6  # the largest finite logit, before any NaN
    weight[SLICE + 9, 3] = float("nan")
    weight[SLICE + 700, 0] = float("nan")
    x = torch.rand(rows, 8) + 0.5
    ids = greedy(extension, x, weight)
    assert ids.tolist() == [SLICE + 9] * rows
    assert torch.equal(ids, (x @ weight.t()).argmax(dim=-1))


def test_rows_of_minus_infinity_pick_index_zero(extension, isa):
    x = torch.full((3, 8), -1e38)
    weight = torch.ones(SLICE + 3, 8)
    assert greedy(extension, x, weight).tolist() == [0, 0, 0]


def test_reads_strided_rows_and_handles_no_rows(extension):
    torch.manual_seed(1)
    weight = torch.randn(300, 16)
    wide = torch.randn(4, 40)
    x = wide[:, 8:24]
    assert torch.equal(greedy(extension, x, weight), (x @ weight.t()).argmax(dim=-1))
    assert greedy(extension, torch.empty(0, 16), weight).shape == (0,)


@pytest.mark.parametrize(
    "x, weight, weight_t, message",
    [
        (torch.randn(2, 8).double(), torch.randn(9, 8), torch.randn(8, 9), "fp32 only"),
        (torch.randn(2, 8), torch.randn(9, 8), torch.randn(9, 8), "weight_t must be weight transposed"),
        (torch.randn(2, 7), torch.randn(9, 8), torch.randn(8, 9), "hidden has 7 features"),
    ],
)
def test_refuses_what_it_cannot_compute(extension, x, weight, weight_t, message):
    with pytest.raises(RuntimeError, match=message):
        extension.greedy_lm_head(x, weight, weight_t, 16)


@pytest.mark.parametrize("rows", [1, cpu_linear.GEMV_MAX_ROWS, cpu_linear.GEMV_MAX_ROWS + 1, 64])
def test_module_logits_match_nn_linear_and_greedy_matches_their_argmax(extension, rows):
    torch.manual_seed(rows)
    linear = nn.Linear(48, 3000, bias=False)
    head = cpu_lm_head.CpuLmHead(linear, extension)
    x = torch.randn(rows, 48)
    logits = head(x)
    torch.testing.assert_close(logits, linear(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(head.greedy(x), logits.argmax(dim=-1))


class WithHead(nn.Module):
    def __init__(self, bias: bool = False, dtype: torch.dtype = torch.float32, hidden: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(50, hidden)
        self.lm_head = nn.Linear(hidden, 50, bias=bias).to(dtype)


def test_swaps_only_a_bias_free_fp32_head_and_keeps_it_tied(extension):
    tied = WithHead()
    tied.lm_head.weight = tied.embed_tokens.weight
    assert cpu_lm_head.use_cpu_lm_head(tied, extension)
    assert isinstance(tied.lm_head, cpu_lm_head.CpuLmHead)
    assert tied.lm_head.weight.data_ptr() == tied.embed_tokens.weight.data_ptr(), "no copy of a tied weight"
    assert cpu_linear.use_cpu_linears(tied, extension) == 0, "the linear swap leaves the LM head alone"
    assert not cpu_lm_head.use_cpu_lm_head(WithHead(bias=True), extension)
    too_wide = WithHead(hidden=cpu_lm_head.MAX_HIDDEN_SIZE + 1)
    assert not cpu_lm_head.use_cpu_lm_head(too_wide, extension), "a head this wide stays a CpuLinear"
    assert not cpu_lm_head.use_cpu_lm_head(WithHead(dtype=torch.bfloat16), extension)


@pytest.mark.parametrize(
    "params, suppressed, expected",
    [
        (SamplingParams(temperature=0.0), set(), True),
        (SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3), set(), True),
        (SamplingParams(temperature=0.7), set(), False),
        (SamplingParams(temperature=0.0, logprobs=1), set(), False),
        (SamplingParams(temperature=0.0, logit_bias={3: 5.0}), set(), False),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), set(), False),
        (SamplingParams(temperature=0.0), {2}, False),
    ],
)
def test_argmax_suffices_only_when_the_sampler_would_return_the_argmax(params, suppressed, expected):
    greedy_row = SamplingParams(temperature=0.0)
    assert argmax_suffices([greedy_row, params], [set(), suppressed]) is expected


class LogitsSpy:
    def __init__(self, model) -> None:
        self.model, self.calls = model, 0
        self._compute_logits = model.compute_logits

    def __call__(self, hidden):
        self.calls += 1
        return self._compute_logits(hidden)


@pytest.mark.parametrize("logprobs, logits_calls", [(0, 0), (2, 1)])
def test_engine_computes_logits_only_when_the_sampler_needs_them(extension, logprobs, logits_calls):
    hf = tiny_hf_model(seed=3)
    engine = engine_for(hf)
    assert isinstance(engine.model.lm_head, cpu_lm_head.CpuLmHead)
    spy = LogitsSpy(engine.model)
    engine.model.compute_logits = spy
    prompt = [5, 9, 77, 3]
    seq = engine.make_sequence(
        prompt, SamplingParams(temperature=0.0, logprobs=logprobs), StoppingParams(max_tokens=1), "r"
    )
    engine.allocate(seq, seq.num_tokens)
    (output,) = engine.step([ScheduledChunk(seq, seq.num_tokens)])
    assert spy.calls == logits_calls
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1].argmax().item()
    assert output.token_id == expected


@pytest.mark.parametrize("rows", [3, 40])
def test_slices_split_between_threads_give_the_same_answer(extension, rows):
    torch.manual_seed(rows)
    weight = torch.randn(5 * SLICE + 7, 24)
    weight[3 * SLICE + 1] = weight[SLICE + 2] = 50.0  # a tie in slices two threads take
    x = torch.rand(rows, 24) + 0.1
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ids = greedy(extension, x, weight)
        weight[4 * SLICE, 0] = float("nan")
        with_nan = greedy(extension, x, weight)
    finally:
        torch.set_num_threads(before)
    assert ids.tolist() == [SLICE + 2] * rows
    assert with_nan.tolist() == [4 * SLICE] * rows
