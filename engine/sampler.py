"""Batched next-token sampling: logit bias, penalties, greedy, temperature, top-k, top-p, min-p, per-request
seeds, logprobs.

Everything runs in fp32 over the whole [B, V] batch with one pass per mask, so the cost does not grow
with the number of distinct parameter combinations in the batch. Sampling uses the exponential race
(argmax of logit - log(E) with E ~ Exp(1), the Gumbel-max trick), which needs no softmax or cumsum over
the vocabulary and lets each seeded row draw its own noise from a generator keyed by (seed, position):
a seeded request then gets the same tokens whatever else shares its batch and wherever its row is.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.grammar import GrammarMask
from engine.params import SamplingParams

_MASK_64 = (1 << 64) - 1
SEED_MASK = _MASK_64  # seeds are uint64 on the wire; derived seeds wrap around

# Width of the column blocks `greedy_argmax` reduces first (see there).
_ARGMAX_BLOCK = 128


def _splitmix64(value: int) -> int:
    """One splitmix64 step: a cheap bijective mixer, so nearby inputs give unrelated outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK_64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return value ^ (value >> 31)


def row_seed(seed: int, position: int) -> int:
    """The generator seed for one (request seed, position) pair; stable across processes and versions
    (unlike `hash()`), and below 2**63 so every torch backend accepts it."""
    return _splitmix64(_splitmix64(seed & _MASK_64) ^ (position & _MASK_64)) >> 1


class TokenHistory(NamedTuple):
    """One row's tokens so far (prompt then generated), which the penalties look at."""

    token_ids: Sequence[int]
    num_prompt_tokens: int


def penalize(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor:
    """Return `logits` [B, V] with each row's logit bias, then its penalties, applied (OpenAI/vLLM semantics).

    Bias is added first. Repetition penalty r then touches every token in the prompt or the output: a
    positive logit is divided by r, a negative one multiplied by it (so r > 1 always discourages).
    Finally, over the generated tokens only, frequency penalty subtracts once per occurrence and presence
    penalty once per distinct token. Rows without bias or penalties are left as they are.
    """
    device = logits.device
    vocab = logits.shape[1]
    bias_rows = [row for row, p in enumerate(params) if p.logit_bias]
    if bias_rows:
        rows = [row for row in bias_rows for token_id, _ in params[row].logit_bias if token_id < vocab]
        cols = [token_id for row in bias_rows for token_id, _ in params[row].logit_bias if token_id < vocab]
        bias = [b for row in bias_rows for token_id, b in params[row].logit_bias if token_id < vocab]
        logits = logits.index_put(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.tensor(bias, dtype=logits.dtype, device=device),
            accumulate=True,
        )
    penalized = [row for row, p in enumerate(params) if p.has_penalties]
    if not penalized:
        return logits
    output_counts = torch.zeros((len(penalized), vocab), dtype=logits.dtype, device=device)
    seen = torch.zeros((len(penalized), vocab), dtype=torch.bool, device=device)
    out_rows: list[int] = []
    out_cols: list[int] = []
    prompt_rows: list[int] = []
    prompt_cols: list[int] = []
    for i, row in enumerate(penalized):
        history = histories[row]
        generated = history.token_ids[history.num_prompt_tokens :]
        out_rows.extend([i] * len(generated))
        out_cols.extend(generated)
        if params[row].repetition_penalty != 1:
            prompt = history.token_ids[: history.num_prompt_tokens]
            prompt_rows.extend([i] * len(prompt))
            prompt_cols.extend(prompt)
    if out_rows:
        index = (torch.tensor(out_rows, device=device), torch.tensor(out_cols, device=device))
        output_counts.index_put_(index, torch.ones(len(out_rows), dtype=logits.dtype, device=device), True)
    if prompt_rows:
        seen[torch.tensor(prompt_rows, device=device), torch.tensor(prompt_cols, device=device)] = True
    seen |= output_counts > 0

    def column(name: str) -> torch.Tensor:
        values = [getattr(params[row], name) for row in penalized]
        return torch.tensor(values, dtype=logits.dtype, device=device).unsqueeze(1)

    index = torch.tensor(penalized, device=device)
    rows_logits = logits.index_select(0, index)
    repetition = column("repetition_penalty")
    repeated = torch.where(rows_logits > 0, rows_logits / repetition, rows_logits * repetition)
    rows_logits = torch.where(seen, repeated, rows_logits)
    rows_logits -= column("frequency_penalty") * output_counts
    rows_logits -= column("presence_penalty") * (output_counts > 0).to(logits.dtype)
    return logits.index_copy(0, index, rows_logits)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` (the first index of each row's maximum, NaN counting as the maximum),
    computed in two passes that vectorise.

    torch's CPU argmax over a long row is a scalar loop: over 128 rows of a 49k vocabulary it takes as
    long as the forward of a small model. The maximum of each 128-wide block (a vectorised `amax`), the
    first block holding the row's maximum, then the first maximum inside that block give the same index
    in about a quarter of the time.
    """
    batch, vocab = logits.shape
    if vocab < 2 * _ARGMAX_BLOCK:
        return logits.argmax(dim=-1)
    head = vocab - vocab % _ARGMAX_BLOCK
    blocks = logits[:, :head].unflatten(1, (head // _ARGMAX_BLOCK, _ARGMAX_BLOCK))
    block_index = blocks.amax(dim=-1).argmax(dim=-1)
    rows = torch.arange(batch, device=logits.device)
    token_ids = block_index * _ARGMAX_BLOCK + blocks[rows, block_index].argmax(dim=-1)
    if head == vocab:
        return token_ids
    # The ragged tail wins only when strictly larger (or NaN where the head has none): ties go to the
    # head, whose indices come first.
    tail = logits[:, head:]
    tail_index = tail.argmax(dim=-1)
    best_head, best_tail = logits[rows, token_ids], tail[rows, tail_index]
    tail_wins = (best_tail > best_head) | (best_tail.isnan() & ~best_head.isnan())
    return torch.where(tail_wins, tail_index + head, token_ids)


@dataclass
class SamplerOutput:
    """What the sampler picked for each row, with the logprobs the API reports."""

    token_ids: torch.Tensor  # [B] int64
    # [B] fp32: log_softmax of the raw logits at the chosen token; NaN in every row when no row of the
    # batch asked for logprobs (then the vocabulary-wide log_softmax, which would cost more than the
    # rest of the sampler, is skipped).
    logprobs: torch.Tensor
    top_token_ids: torch.Tensor  # [B, N] int64, N = max logprobs requested in the batch (may be 0)
    top_logprobs: torch.Tensor  # [B, N] fp32, raw log-softmax, sorted descending

    @classmethod
    def without_logprobs(cls, token_ids: torch.Tensor) -> SamplerOutput:
        """The output for a batch where no row asked for logprobs."""
        empty = torch.empty((token_ids.shape[0], 0), device=token_ids.device)
        return cls(
            token_ids=token_ids,
            logprobs=torch.full(token_ids.shape, float("nan"), device=token_ids.device),
            top_token_ids=empty.long(),
            top_logprobs=empty,
        )


def argmax_suffices(params: Sequence[SamplingParams], suppress_token_ids: Sequence[Collection[int]]) -> bool:
    """True when the sampler would return each row's argmax of the raw logits and nothing else: every
    row greedy, without logprobs, logit bias, penalties or suppressed ids. Then the logits themselves
    need not exist (`CausalLM.greedy_tokens`)."""
    return all(
        p.is_greedy and not p.logprobs and not p.logit_bias and not p.has_penalties for p in params
    ) and not any(suppress_token_ids)


class Sampler:
    """Picks one token per row of a logits batch.

    Rows without a seed share one generator (seeded from `seed` when given, for reproducible tests,
    else from the OS); seeded rows are independent of it and of each other.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._shared_seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        positions: Sequence[int],
        suppress_token_ids: Sequence[Collection[int]] | None = None,
        histories: Sequence[TokenHistory] | None = None,
        grammar_mask: GrammarMask | None = None,
    ) -> SamplerOutput:
        """Sample one token per row of `logits` [B, V].

        `positions[i]` is how many tokens row i's sequence holds before the sampled one; with the seed
        it fixes the row's randomness. `suppress_token_ids[i]` are ids row i must not produce (ids
        outside the vocabulary are ignored: they cannot be produced anyway). `histories[i]` is row i's
        token history, needed when its params have penalties. `grammar_mask` forbids what each constrained
        row's grammar does not allow next, after bias, penalties and suppression. Logprobs are always of the
        raw logits, before bias, penalties, suppression, grammar, temperature or any mask.
        """
        if logits.dim() != 2:
            raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
        batch, vocab = logits.shape
        if len(params) != batch or len(positions) != batch:
            raise ValueError(f"{batch} logits rows but {len(params)} params and {len(positions)} positions")
        if suppress_token_ids is not None and len(suppress_token_ids) != batch:
            raise ValueError(f"{batch} logits rows but {len(suppress_token_ids)} suppress sets")
        if any(p.has_penalties for p in params) and (histories is None or len(histories) != batch):
            raise ValueError("penalties need one token history per logits row")

        raw_logits = logits = logits.float()
        logits = penalize(logits, params, histories or ())
        if suppress_token_ids is not None:
            logits = self._suppress(logits, suppress_token_ids)
        if grammar_mask is not None:
            if logits is raw_logits:
                logits = logits.clone()
            grammar_mask.apply(logits)

        token_ids = greedy_argmax(logits)
        sampled_rows = [row for row, p in enumerate(params) if not p.is_greedy]
        if sampled_rows:
            rows = torch.tensor(sampled_rows, device=logits.device)
            row_params = [params[row] for row in sampled_rows]
            scaled = self._mask(logits.index_select(0, rows), row_params)
            noise = self._exponential_noise(scaled, row_params, [positions[r] for r in sampled_rows])
            token_ids[rows] = (scaled - noise.log()).argmax(dim=-1)

        num_top = max((p.logprobs for p in params), default=0)
        if num_top == 0:
            return SamplerOutput.without_logprobs(token_ids)
        raw_logprobs = torch.log_softmax(raw_logits, dim=-1)
        chosen_logprobs = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
        top_logprobs, top_token_ids = raw_logprobs.topk(min(num_top, vocab), dim=-1, sorted=True)
        return SamplerOutput(
            token_ids=token_ids,
            logprobs=chosen_logprobs,
            top_token_ids=top_token_ids,
            top_logprobs=top_logprobs,
        )

    @staticmethod
    def _suppress(logits: torch.Tensor, suppress_token_ids: Sequence[Collection[int]]) -> torch.Tensor:
        """Return `logits` with the listed (row, token) entries set to -inf, in one scatter."""
        vocab = logits.shape[1]
        rows: list[int] = []
        cols: list[int] = []
        for row, token_ids in enumerate(suppress_token_ids):
            for token_id in token_ids:
                if 0 <= token_id < vocab:
                    rows.append(row)
                    cols.append(token_id)
        if not rows:
            return logits
        index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        return logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))

    @staticmethod
    def _mask(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Apply temperature, then top-k, top-p and min-p; excluded tokens become -inf.

        Top-k keeps every token tied with the k-th largest logit; top-p keeps the smallest prefix of
        the sorted distribution (after top-k) whose mass reaches p; min-p drops tokens whose
        probability is below min_p times the largest one.
        """
        device = logits.device
        vocab = logits.shape[1]
        neg_inf = float("-inf")
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        logits = logits / temperature.unsqueeze(1)

        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_k):
            # The k-th largest value is exact whichever way it is found, so comparing against it
            # gives every row the same mask whatever else is in the batch.
            max_k = max(k for k in top_k if k < vocab)
            largest = logits.topk(max_k, dim=-1, sorted=True).values
            kth_index = torch.tensor([min(k, max_k) - 1 for k in top_k], device=device).unsqueeze(1)
            kth_value = largest.gather(1, kth_index)
            top_k_off = torch.tensor([k >= vocab for k in top_k], device=device).unsqueeze(1)
            logits = logits.masked_fill((logits < kth_value) & ~top_k_off, neg_inf)

        top_p_rows = [row for row, p in enumerate(params) if p.top_p < 1.0]
        if top_p_rows:
            # Only these rows pay for the full sort; each row's result depends on that row alone.
            rows = torch.tensor(top_p_rows, device=device)
            top_p = torch.tensor([params[r].top_p for r in top_p_rows], dtype=torch.float32, device=device)
            sorted_logits, order = logits.index_select(0, rows).sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1).sub_(probs)
            sorted_logits = sorted_logits.masked_fill(mass_before >= top_p.unsqueeze(1), neg_inf)
            logits[rows] = torch.empty_like(sorted_logits).scatter_(1, order, sorted_logits)

        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
            # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); log(0) = -inf keeps everything.
            threshold = logits.max(dim=-1, keepdim=True).values + min_p.log().unsqueeze(1)
            logits = logits.masked_fill(logits < threshold, neg_inf)
        return logits

    def _exponential_noise(
        self, like: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
    ) -> torch.Tensor:
        """Exp(1) noise shaped like `like`, one row per sampled sequence: seeded rows from
        (seed, position) alone, the rest from the shared generator. Clamped away from 0 so log()
        stays finite and a masked (-inf) token can never win the race."""
        device = like.device
        noise = torch.empty_like(like)
        unseeded = [row for row, p in enumerate(params) if p.seed is None]
        if unseeded:
            shared = self._shared_generator(device)
            if len(unseeded) == len(params):
                noise.exponential_(generator=shared)
            else:
                draw = like.new_empty((len(unseeded), like.shape[1]))
                noise[torch.tensor(unseeded, device=device)] = draw.exponential_(generator=shared)
        row_generator = self._row_generator(device)
        for row, (p, position) in enumerate(zip(params, positions, strict=True)):
            if p.seed is not None:
                row_generator.manual_seed(row_seed(p.seed, position))
                noise[row].exponential_(generator=row_generator)
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self._shared_seed is None:
                generator.seed()
            else:
                generator.manual_seed(self._shared_seed)
            self._shared_generators[device] = generator
        return generator

    def _row_generator(self, device: torch.device) -> torch.Generator:
        generator = self._row_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            self._row_generators[device] = generator
        return generator
