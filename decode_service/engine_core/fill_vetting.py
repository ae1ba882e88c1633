"""Refuses, before admission, a constraint whose token masks are already expensive to fill.

The step bounds what one request's mask fills may cost per token (`engine.grammar_budget`), but only once
a step has paid up to that bound. An ambiguous grammar compiles in milliseconds and fills its first masks
in microseconds, then its fills grow steeply with the text. So the grammar gate probes each grammar it
compiles, on its compile thread (a fill releases the GIL: the engine thread keeps stepping), before any
request uses it: up to `PROBE_TOKENS` fills along the longest token each mask allows, the text growing
as fast as a model can make it. A grammar one of whose probe fills takes more than the fill limit over
`PROBE_SHARE` is refused with `FillCostError` (INVALID_ARGUMENT naming the request field): a request with
that many choices would be at the limit within its first tokens, and the cost was still growing.

Measured on SmolLM2's 49,152-token vocabulary (AMD EPYC, 2 cores, other work running), with the default
limit of 1,000 ms (250 ms per probe fill): the probe of each schema of the structured-output benchmark
takes 0.3 to 22 ms, its slowest fill under 10 ms (the first fill of a server's life computes a UTF-8
row); a 20,000-word enum 91 ms, slowest fill 24 to 42 ms (a string's first characters), then cheaper.
The ambiguous EBNF `x ::= [a-z] | [a-z] x | x [a-z] | x x` fills in 0.14, 12, 36, 98 then 263 ms along
the probe: refused within 5 or 6 fills, 0.4 s; `(([a-z]*)*[a-z]*)*` within 7 to 9, 0.7 s.

The probe follows one answer, so a grammar steep only on another passes it: the step's bound still holds
for that one. A refusal is a measurement, so it is not remembered as xgrammar's refusals are: a repeat is
probed again.
"""

from __future__ import annotations

import time
import weakref

import numpy as np

from decode_service.engine_core.grammar_compiler import ConstraintError
from engine.grammar import GrammarState
from engine.grammar_budget import Clock, probe_fill_times, token_byte_lengths

# Fills of the probe: about 200 to 500 characters of text on a BPE vocabulary.
PROBE_TOKENS = 32
# A probe fill above the fill limit over this is too steep: 6 to 10 times the slowest fill of a 20,000-word
# enum, reached within 5 to 7 fills by the ambiguous grammars.
PROBE_SHARE = 4

# Each vocabulary's token lengths, computed once (0.2 s for 49k tokens) while its UTF-8 table lives.
_lengths: weakref.WeakKeyDictionary[object, np.ndarray] = weakref.WeakKeyDictionary()


class FillCostError(ConstraintError):
    """A constraint whose token masks took too long to fill on the probe of its grammar."""


def vet_fill_cost(state: GrammarState, field: str, limit_s: float, clock: Clock = time.perf_counter) -> None:
    """Raise FillCostError naming `field` when a probe of `state`'s grammar (a fresh state beside it:
    `state` itself is not advanced) has a fill above `limit_s / PROBE_SHARE` seconds (the probe stops
    there)."""
    threshold = limit_s / PROBE_SHARE
    probe = GrammarState(state.compiled, None, state.allowed_tokens, state.source, state.utf8)
    times = probe_fill_times(probe, _byte_lengths(state), PROBE_TOKENS, threshold, clock)
    if times and times[-1] > threshold:
        raise FillCostError(
            field,
            f"the constraint's token mask took {times[-1] * 1000:.0f} ms to compute after {len(times) - 1} "
            f"tokens of a trial answer, steep already against this server's limit of {limit_s * 1000:g} "
            "ms per token (--structured-output-fill-timeout-ms): the grammar is too ambiguous to enforce "
            "as the text grows (nested or overlapping repetitions); write it so that each text parses "
            "one way",
        )


def _byte_lengths(state: GrammarState) -> np.ndarray:
    """The byte length of each token of `state`'s vocabulary (cached by its shared UTF-8 table)."""
    key = state.utf8
    lengths = _lengths.get(key) if key is not None else None
    if lengths is None:
        lengths = token_byte_lengths(state.compiled.tokenizer_info.decoded_vocab)
        if key is not None:
            _lengths[key] = lengths
    return lengths
