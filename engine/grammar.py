"""Grammar-constrained decoding: one sequence's place in its grammar, and the token mask it allows.

A request with a constraint (JSON schema, regex, choice, EBNF, a required tool call) carries a grammar
compiled by xgrammar before admission. Its `GrammarState` walks the grammar token by token: before each
sample it writes the tokens the grammar allows next into a bitmask row, the sampler sends every other
logit to -inf, and the sampled token advances the state. Only constrained rows pay for any of this.

A grammar can wait for a token before it starts (`activate_after`): a reasoning model thinks freely and
the constraint applies to what it writes after `</think>`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from base.errors import TandemError


class GrammarViolationError(TandemError):
    """A token the grammar does not allow was appended (a bug: the mask should have prevented it)."""


def control_free_tokens(info: xgr.TokenizerInfo) -> torch.Tensor:
    """A bitmask row allowing exactly the tokens whose bytes hold no ASCII control character.

    JSON forbids raw control characters inside strings, yet xgrammar's string rules for bounded lengths
    admit them (`[^"\\\r\n]`); compact JSON needs none anywhere, so JSON grammars are ANDed with this.
    """
    allowed = [not any(byte < 0x20 for byte in token) for token in info.decoded_vocab]
    row = torch.zeros(len(allowed) + 31 >> 5, dtype=torch.int64)
    for token_id, ok in enumerate(allowed):
        if ok:
            row[token_id >> 5] |= 1 << (token_id & 31)
    # Two's complement view: bit 31 set must read as a negative int32, as xgrammar's bitmask stores it.
    return torch.where(row >= 1 << 31, row - (1 << 32), row).to(torch.int32)


class GrammarState:
    """One sequence's matcher over a compiled grammar.

    `allowed_tokens` (a bitmask row, see `control_free_tokens`) further restricts what the grammar
    allows; `activate_after` keeps the grammar dormant until that token has been generated. `source`
    (xgrammar kind, text) is what it was compiled from, so an engine in another process can compile it
    again.
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        activate_after: int | None = None,
        allowed_tokens: torch.Tensor | None = None,
        source: tuple[str, str] | None = None,
    ) -> None:
        self.compiled = compiled
        self.activate_after = activate_after
        self.allowed_tokens = allowed_tokens
        self.source = source
        self.active = activate_after is None
        self._matcher = xgr.GrammarMatcher(compiled)

    def fork(self) -> GrammarState:
        """A fresh state at the grammar's start (another choice of the same request)."""
        return GrammarState(self.compiled, self.activate_after, self.allowed_tokens, self.source)

    @property
    def is_terminated(self) -> bool:
        """True once the grammar is complete and has accepted its end: nothing more may be generated."""
        return self.active and self._matcher.is_terminated()

    def accept(self, token_id: int) -> None:
        """Advance past a generated token (before activation: only watch for the activating token)."""
        if not self.active:
            self.active = token_id == self.activate_after
            return
        if not self._matcher.accept_token(token_id):
            raise GrammarViolationError(f"token {token_id} is not allowed by the request's grammar here")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (an active state only)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self.allowed_tokens is not None:
            width = min(bitmask.shape[1], self.allowed_tokens.shape[0])
            bitmask[row, :width] &= self.allowed_tokens[:width]

    def jump_forward_tokens(self) -> list[int]:
        """Tokens spelling the text the grammar forces next whatever the model prefers (empty when it
        leaves a choice, and before activation). They are not accepted yet: `accept` each."""
        return self._matcher.find_jump_forward_tokens() if self.active else []


class GrammarMask:
    """The allowed-token bitmask of one sampling batch's constrained rows, filled before the logits exist."""

    def __init__(self, grammars: Sequence[GrammarState | None], vocab_size: int) -> None:
        self.rows = [row for row, grammar in enumerate(grammars) if grammar is not None and grammar.active]
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
        for row in self.rows:
            grammars[row].fill(self.bitmask, row)

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
