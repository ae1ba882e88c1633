"""What a constrained request's token masks may cost the step, and a probe of that cost before admission.

xgrammar fills a mask in a time that depends on the grammar and on the text generated so far. For most
constraints it is microseconds whatever the length; for an ambiguous one (`x ::= [a-z] | x x`, the regex
`(([a-z]*)*[a-z]*)*`) it grows steeply with the text, to a second per fill within 100 characters and
more after, and the step fills every constrained row, each choice of a request with n > 1 once, one
after another. Without a bound one cheap request stalls the step, and every tenant's stream with it,
until the engine heartbeat kills the core.

A fill releases the GIL but cannot be interrupted: a deadline could only abandon one, which would go on
using a core for as long as it takes. So the bound is measured. Each step the fills of one request's rows
(all its choices) are timed together with `FillBudget.clock`; once they pass `limit_s` the request's
remaining rows are not filled, and the request ends at its next accept with `GrammarFillTimeoutError`
(INVALID_ARGUMENT, naming the request field of the constraint), its tokens of this step discarded. The
step overruns the limit by at most the fill that crossed it, and since a token adds only a few
characters to the text, that fill costs about what the one before it did, which was within the limit.

`probe_fill_times` measures a grammar before any request uses it: it drives a fresh state along the
longest token each mask allows (the text grows fastest so) and times each fill, so that the grammar gate
can refuse a grammar whose fills are already steep before it costs a step anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import xgrammar as xgr

from base.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.grammar import GrammarState

Clock = Callable[[], float]


class GrammarFillTimeoutError(InvalidRequestError):
    """A request whose constraint's token masks took longer to fill for one token than the server allows.

    INVALID_ARGUMENT, not RESOURCE_EXHAUSTED: the cost comes from the constraint and the text it admits,
    so the same request would fail again; only a less ambiguous constraint can pass.
    """

    def __init__(self, field: str, spent_s: float, limit_s: float, num_rows: int) -> None:
        self.field = field
        choices = f"its {num_rows} choices together" if num_rows > 1 else "one choice"
        super().__init__(
            f"{field}: the constraint's token mask took {spent_s * 1000:.0f} ms to compute for one token "
            f"({choices}), past this server's limit of {limit_s * 1000:g} ms "
            "(--structured-output-fill-timeout-ms): the grammar is too ambiguous to enforce as the text "
            "grows (nested or overlapping repetitions); write it so that each text parses one way"
        )


class FillBudget:
    """One request's bound on mask-fill time per token, shared by the grammar states of all its choices.

    `field` is the request field of the constraint (for the error); `clock` times the fills (injectable:
    tests decide what a fill costs). Once spent, `exceeded` holds the error every choice ends with.
    """

    def __init__(self, limit_s: float, field: str, clock: Clock = time.perf_counter) -> None:
        self.limit_s = limit_s
        self.field = field
        self.clock = clock
        self.exceeded: GrammarFillTimeoutError | None = None

    def charge(self, spent_s: float, num_rows: int) -> None:
        """The request's fills of this token took `spent_s` over `num_rows` rows so far: past the limit,
        the request is over its budget for good."""
        if spent_s > self.limit_s and self.exceeded is None:
            self.exceeded = GrammarFillTimeoutError(self.field, spent_s, self.limit_s, num_rows)


def token_byte_lengths(decoded_vocab: list[bytes]) -> np.ndarray:
    """Each token's length in bytes, what `probe_fill_times` ranks allowed tokens by."""
    return np.fromiter((len(data) for data in decoded_vocab), dtype=np.int64, count=len(decoded_vocab))


def probe_fill_times(
    state: GrammarState,
    byte_lengths: np.ndarray,
    max_tokens: int,
    stop_above_s: float,
    clock: Clock = time.perf_counter,
) -> list[float]:
    """Seconds of each fill of `state` (a fresh, active state no request uses) along the longest allowed
    token each time, stop tokens excluded: at most `max_tokens` fills, fewer when the grammar allows no
    token but a stop token, or a fill takes more than `stop_above_s` (the last time returned is then
    that fill's)."""
    vocab_size = len(byte_lengths)
    stop_ids = [i for i in state.compiled.tokenizer_info.stop_token_ids if i < vocab_size]
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    times: list[float] = []
    for _ in range(max_tokens):
        start = clock()
        state.fill(bitmask, 0)
        times.append(clock() - start)
        if times[-1] > stop_above_s:
            break
        allowed = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
        allowed[stop_ids] = 0
        if not allowed.any():
            break
        state.accept(int(np.argmax(np.where(allowed.astype(bool), byte_lengths, -1))))
    return times
