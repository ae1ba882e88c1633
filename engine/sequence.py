"""One request's state inside the engine: its tokens, its block table, and why it stopped.

Token ids only: text, and the stop strings matched against it, are the front door's (the decode tier's
`decode_service.front_door.choice_text`), so an engine step never detokenizes.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection
from collections.abc import Sequence as SequenceOf

from engine.grammar import GrammarState
from engine.params import SamplingParams, StoppingParams
from engine.speculation import NgramDrafts


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


class Sequence:
    """Prompt plus generated tokens of one request, and where their KV lives in the paged cache.

    `num_computed_tokens` counts tokens whose KV is already in the cache; the next forward for this
    sequence starts there. It starts at the cached prefix the block manager found at admission; after a
    preemption the history is matched against the cache again and only the rest is recomputed.
    `block_hashes` are the chain hashes of the full blocks seen so far (computed once: full blocks never
    change), `num_committed_blocks` how many logical blocks have been registered for reuse.

    `block_tables` holds one table per KV group of the model (`engine.kv_layout`, in layout order), all of
    the same length (logical blocks covered); a sliding group's entries below its window are
    `NULL_BLOCK`. The block manager sizes the list on first allocation; `block_table` is group 0's.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        sampling: SamplingParams,
        stopping: StoppingParams,
        arrival_time: float | None = None,
        cache_salt: str = "",
        grammar: GrammarState | None = None,
    ) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling = sampling
        self.stopping = stopping
        self.grammar = grammar
        self.block_tables: list[list[int]] = [[]]
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self.num_cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.matched_stop: str | int | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Its n-gram lookup table, built at its first draft when the engine speculates.
        self.drafts: NgramDrafts | None = None

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table: the only one of a model whose layers all attend alike."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def suppressed_token_ids(self, eos_token_ids: Collection[int], ahead: int = 0) -> frozenset[int]:
        """Tokens that would end the sequence before `min_tokens` have been generated (`ahead`: after that
        many more tokens, a draft's, were appended).

        None while a grammar constrains the output: the grammar alone decides when it may end (it allows
        EOS only once complete, and forbidding it then would leave no token at all).
        """
        if self.num_output_tokens + ahead >= self.stopping.min_tokens or (
            self.grammar is not None and self.grammar.active
        ):
            return frozenset()
        eos = () if self.stopping.ignore_eos else eos_token_ids
        return frozenset(eos) | frozenset(self.stopping.stop_token_ids)

    def append_token(self, token_id: int, eos_token_ids: Collection[int], max_model_len: int) -> None:
        """Add a sampled token and decide whether the sequence is done.

        A grammar advances first, and the token is appended only if it accepts it (GrammarDeadEndError
        when the grammar allowed no token at all, GrammarViolationError for a token it forbids); once it
        has accepted its end (EOS, even with ignore_eos or before min_tokens) the sequence stops. Then
        stop tokens and EOS (from min_tokens on), then the length limits. Stop strings are matched by the
        front door, which ends the sequence through `stop_at_string`.
        """
        grammar = self.grammar
        if grammar is not None:
            grammar.accept(token_id)
        self.token_ids.append(token_id)
        stopping = self.stopping
        if grammar is not None and grammar.is_terminated:
            self._finish(FinishReason.STOP, token_id if token_id in stopping.stop_token_ids else None)
            return
        if self.num_output_tokens > stopping.min_tokens or stopping.min_tokens == 0:
            if token_id in stopping.stop_token_ids:
                self._finish(FinishReason.STOP, token_id)
                return
            if not stopping.ignore_eos and token_id in eos_token_ids:
                self._finish(FinishReason.STOP, token_id)
                return
        if self.num_output_tokens >= stopping.max_tokens or self.num_tokens >= max_model_len:
            self._finish(FinishReason.LENGTH, None)

    def _finish(self, reason: FinishReason, matched: str | int | None) -> None:
        self.finish_reason, self.matched_stop = reason, matched

    def stop_at_string(self, stop: str) -> None:
        """The front door found stop string `stop` in the text: the sequence ends as stopped by it."""
        self._finish(FinishReason.STOP, stop)

    def abort(self) -> None:
        self.finish_reason = FinishReason.ABORT
