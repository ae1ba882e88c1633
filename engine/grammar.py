"""Grammar-constrained decoding: one sequence's place in its grammar, and the token mask it allows.

A request with a constraint (JSON schema, regex, choice, EBNF, a required tool call) carries a grammar
compiled by xgrammar before admission. Its `GrammarState` walks the grammar token by token: before each
sample it writes the tokens the grammar allows next into a bitmask row, the sampler sends every other
logit to -inf, and the sampled token advances the state. Only constrained rows pay for any of this.

A grammar can wait for a token before it starts (`activate_after`): a reasoning model thinks freely and
the constraint applies to what it writes after `</think>`.

What the client receives is text, so the mask also keeps the bytes valid UTF-8 (`engine.utf8_tokens`):
xgrammar alone lets surrogates and split characters through, which decode to U+FFFD. A grammar that
allows no token at all (an impossible pattern, a rule with no way out) ends its own request with
`GrammarDeadEndError` when its next token is accepted; the rest of the batch goes on. So does one whose
masks take longer to fill than its `FillBudget` allows (`engine.grammar_budget`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from base.errors import InvalidRequestError, TandemError
from engine.grammar_budget import FillBudget
from engine.utf8_tokens import BOUNDARY, Utf8Tokens, pack_bitmask_row


class GrammarViolationError(TandemError):
    """A token the grammar does not allow was appended (a bug: the mask should have prevented it)."""


class GrammarDeadEndError(InvalidRequestError):
    """The request's constraint allows no token where its answer stands: nothing can satisfy it."""


def control_free_tokens(info: xgr.TokenizerInfo) -> torch.Tensor:
    """A bitmask row allowing exactly the tokens whose bytes hold no ASCII control character.

    JSON forbids raw control characters inside strings, yet xgrammar's string rules for bounded lengths
    admit them (`[^"\\\r\n]`); compact JSON needs none anywhere, so JSON grammars are ANDed with this.
    """
    allowed = [not any(byte < 0x20 for byte in token) for token in info.decoded_vocab]
    return pack_bitmask_row(np.array(allowed, dtype=bool))


class GrammarState:
    """One sequence's matcher over a compiled grammar.

    `allowed_tokens` (a bitmask row, see `control_free_tokens`) further restricts what the grammar
    allows; `utf8` (shared by every state of a vocabulary) keeps the bytes valid UTF-8, and the servers
    always pass it. `activate_after` keeps the grammar dormant until that token has been generated.
    `source` (xgrammar kind, text) is what it was compiled from, so an engine in another process can
    compile it again. `budget` bounds the time its masks may take to fill per token, shared with the
    states of the request's other choices (None: unbounded).
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        activate_after: int | None = None,
        allowed_tokens: torch.Tensor | None = None,
        source: tuple[str, str] | None = None,
        utf8: Utf8Tokens | None = None,
        budget: FillBudget | None = None,
    ) -> None:
        self.compiled = compiled
        self.activate_after = activate_after
        self.allowed_tokens = allowed_tokens
        self.source = source
        self.utf8 = utf8
        self.budget = budget
        self.active = activate_after is None
        self._matcher = xgr.GrammarMatcher(compiled)
        self._utf8_state = BOUNDARY
        # Set by `fill` when the mask it wrote allows nothing: the next `accept` ends the request.
        self._dead_end = False

    def fork(self) -> GrammarState:
        """A fresh state at the grammar's start (another choice of the same request: the same budget)."""
        return GrammarState(
            self.compiled, self.activate_after, self.allowed_tokens, self.source, self.utf8, self.budget
        )

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and has accepted its end: nothing more may be generated."""
        return self.active and self._matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        """Advance past a generated token (before activation: only watch for the activating token).

        Raises GrammarFillTimeoutError when the request's masks took longer to fill than its budget
        allows (whatever was sampled then may not be the grammar's), GrammarDeadEndError when the last
        mask allowed no token, GrammarViolationError for a token the mask should have refused.
        """
        if not self.active:
            self.active = token_id == self.activate_after
            return
        if self.budget is not None and self.budget.exceeded is not None:
            raise self.budget.exceeded
        if self._dead_end:
            raise GrammarDeadEndError(
                "the request's constraint allows no token at this point of the answer, so no text can "
                "satisfy it: check its schema's patterns and lengths, or its grammar's rules"
            )
        if self.utf8 is not None:
            after = self.utf8.advance(self._utf8_state, token_id)
            if after is None:
                raise GrammarViolationError(f"token {token_id} would break the answer's UTF-8 here")
            self._utf8_state = after
        if not self._matcher.accept_token(token_id):
            raise GrammarViolationError(f"token {token_id} is not allowed by the request's grammar here")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (an active state only)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed_tokens is not None:
            _restrict(bitmask, row, self.allowed_tokens)
        if self.utf8 is not None:
            _restrict(bitmask, row, self.utf8.row(self._utf8_state))
        self._dead_end = not bool(bitmask[row].any())

    def jump_forward_tokens(self) -> list[int]:
        """Tokens spelling the text the grammar forces next whatever the model prefers (empty when it
        leaves a choice, and before activation), cut before any that would break the UTF-8. They are
        not accepted yet: `accept` each."""
        if not self.active:
            return []
        forced = self._matcher.find_jump_forward_tokens()
        if self.utf8 is None:
            return forced
        state = self._utf8_state
        for index, token_id in enumerate(forced):
            state = self.utf8.advance(state, token_id)
            if state is None:
                return forced[:index]
        return forced


def _restrict(bitmask: torch.Tensor, row: int, allowed: torch.Tensor) -> None:
    """AND `bitmask[row]` with the bitmask row `allowed` (tokens past its end keep the grammar's bits)."""
    width = min(bitmask.shape[1], allowed.shape[0])
    bitmask[row, :width] &= allowed[:width]


class GrammarMask:
    """The allowed-token bitmask of one sampling batch's constrained rows, filled before the logits exist.

    The rows of a request with a `FillBudget` are timed together (its choices share it); once they pass
    its limit, its remaining rows stay unfilled (all tokens allowed) and the request ends when its
    sampled tokens are accepted, none of them appended.
    """

    def __init__(self, grammars: Sequence[GrammarState | None], vocab_size: int) -> None:
        self.rows = [row for row, grammar in enumerate(grammars) if grammar is not None and grammar.active]
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
        # Per request budget: (seconds its rows took to fill in this mask, rows filled).
        spent: dict[FillBudget, tuple[float, int]] = {}
        for row in self.rows:
            grammar = grammars[row]
            budget = grammar.budget
            if budget is None:
                grammar.fill(self.bitmask, row)
                continue
            if budget.exceeded is not None:
                continue
            start = budget.clock()
            grammar.fill(self.bitmask, row)
            seconds, num_rows = spent.get(budget, (0.0, 0))
            spent[budget] = (seconds + budget.clock() - start, num_rows + 1)
            budget.charge(*spent[budget])

    @classmethod
    def fill(cls, grammars: Sequence[GrammarState | None], vocab_size: int) -> GrammarMask | None:
        """The mask of a batch, or None when no row has an active grammar (the common case costs one scan)."""
        if all(grammar is None or not grammar.active for grammar in grammars):
            return None
        return cls(grammars, vocab_size)

    def apply(self, logits: torch.Tensor) -> None:
        """Send every logit a row's grammar forbids to -inf, in place; unconstrained rows are untouched."""
        xgr.apply_token_bitmask_inplace(
            logits, self.bitmask.to(logits.device), vocab_size=self.vocab_size, indices=self.rows
        )
