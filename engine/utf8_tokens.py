"""Which tokens keep a constrained answer valid UTF-8: a byte-level decoder state and, per state, a mask.

xgrammar matches bytes: its string rules and character classes accept a UTF-16 surrogate written as
UTF-8 (`ED A0..BF xx`) as one character, and a byte-level or byte-fallback vocabulary (`<0xE2>`) lets
a model split a character between tokens or leave it unfinished. The client then decodes U+FFFD where
the grammar counted one character, and a `maxLength` or a pattern no longer holds. So every constrained
sequence also carries where it stands in the UTF-8 decoder (a character boundary, or which continuation
bytes are still due and the range the next one must fall in), and its grammar mask is ANDed with the
tokens whose bytes continue validly from there.

A state's row is computed once per vocabulary, when a sequence first stands in that state, and shared by
every sequence of that vocabulary: eight states at most, and a row costs one pass over the vocabulary's
bytes (the decoder's C fast path for the many tokens that are whole characters).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import xgrammar as xgr

BOUNDARY = 0
# What a state still needs: (continuation bytes due, lowest and highest value of the next one). The
# narrowed ranges after E0, ED, F0 and F4 refuse overlong forms, surrogates and code points past U+10FFFF.
_STATES = (
    (0, 0, 0),  # boundary
    (1, 0x80, 0xBF),
    (2, 0x80, 0xBF),
    (2, 0xA0, 0xBF),  # after E0
    (2, 0x80, 0x9F),  # after ED
    (3, 0x80, 0xBF),
    (3, 0x90, 0xBF),  # after F0
    (3, 0x80, 0x8F),  # after F4
)
NUM_STATES = len(_STATES)
_INVALID = 0xFF


def _lead_state(byte: int) -> int:
    """The state after `byte` read at a character boundary (`_INVALID`: no character starts so)."""
    if byte < 0x80:
        return BOUNDARY
    if 0xC2 <= byte <= 0xDF:
        return 1
    if byte == 0xE0:
        return 3
    if byte == 0xED:
        return 4
    if 0xE1 <= byte <= 0xEF:
        return 2
    if byte == 0xF0:
        return 6
    if 0xF1 <= byte <= 0xF3:
        return 5
    if byte == 0xF4:
        return 7
    return _INVALID


def _transitions() -> tuple[bytes, ...]:
    """The decoder as a table: `table[state][byte]` is the next state, `_INVALID` for a refused byte."""
    table = []
    for due, low, high in _STATES:
        if due == 0:
            table.append(bytes(_lead_state(byte) for byte in range(256)))
            continue
        after = (BOUNDARY, 1, 2)[due - 1]
        table.append(bytes(after if low <= byte <= high else _INVALID for byte in range(256)))
    return tuple(table)


_NEXT = _transitions()


def walk(state: int, data: bytes) -> int | None:
    """The decoder state after reading `data` from `state`; None when `data` is not valid from there.

    Only the bytes that finish the pending character, and a character `data` leaves unfinished, go
    through the table one by one; the whole characters between are checked by Python's strict UTF-8
    decoder (which refuses surrogates, overlong forms and stray bytes just as the table does).
    """
    index = 0
    while state != BOUNDARY:
        if index == len(data):
            return state
        state = _NEXT[state][data[index]]
        if state == _INVALID:
            return None
        index += 1
    rest = data[index:] if index else data
    if rest.isascii():
        return BOUNDARY
    try:
        rest.decode("utf-8")
    except UnicodeDecodeError as error:
        # Everything before `error.start` decoded: the decoder stands at a boundary there, and what
        # follows is either one unfinished character (at most three bytes) or invalid within four.
        for byte in rest[error.start :]:
            state = _NEXT[state][byte]
            if state == _INVALID:
                return None
    return state


def pack_bitmask_row(allowed: np.ndarray) -> torch.Tensor:
    """A bool vector over token ids as one row of xgrammar's token bitmask: int32 words, bit i of word w
    for token 32 w + i (little-endian words, so packing bits little-endian lays them out as xgrammar)."""
    packed = np.packbits(allowed, bitorder="little")
    words = np.zeros(-(-len(packed) // 4) * 4, dtype=np.uint8)
    words[: len(packed)] = packed
    return torch.from_numpy(words.view("<i4").copy())


class Utf8Tokens:
    """Per decoder state, the tokens of one vocabulary that continue valid UTF-8, and where they lead.

    `decoded_vocab[i]` is token i's bytes as it adds them to the text. `transparent_ids` (stop and
    special tokens) add no text of their own: allowed in every state, they leave it as it is, so the
    grammar alone decides when they may come. Thread-safe enough for its use: a row computed twice by
    racing threads is the same row.
    """

    def __init__(self, decoded_vocab: Sequence[bytes], transparent_ids: Iterable[int] = ()) -> None:
        self._vocab = decoded_vocab
        self._transparent = sorted({i for i in transparent_ids if 0 <= i < len(decoded_vocab)})
        self._next: list[bytearray | None] = [None] * NUM_STATES
        self._rows: list[torch.Tensor | None] = [None] * NUM_STATES
        self._continuing: list[int] | None = None

    @classmethod
    def of(cls, info: xgr.TokenizerInfo) -> Utf8Tokens:
        """The table of xgrammar's view of a vocabulary (its decoded bytes, byte-fallback tokens included)."""
        return cls(info.decoded_vocab, [*info.stop_token_ids, *info.special_token_ids])

    def row(self, state: int) -> torch.Tensor:
        """The bitmask row (see `pack_bitmask_row`) of the tokens allowed in `state`."""
        row = self._rows[state]
        if row is None:
            allowed = np.frombuffer(self._table(state), dtype=np.uint8) != _INVALID
            row = self._rows[state] = pack_bitmask_row(allowed)
        return row

    def advance(self, state: int, token_id: int) -> int | None:
        """The state after token `token_id`; None when it would break the text's UTF-8."""
        table = self._table(state)
        if not 0 <= token_id < len(table):
            return None
        after = table[token_id]
        return None if after == _INVALID else after

    def _table(self, state: int) -> bytearray:
        """`table[token_id]`: the state after each token read from `state` (`_INVALID`: refused)."""
        table = self._next[state]
        if table is not None:
            return table
        vocab = self._vocab
        if state == BOUNDARY:
            table = bytearray(len(vocab))
            for token_id, data in enumerate(vocab):
                if not data.isascii():
                    after = walk(BOUNDARY, data)
                    table[token_id] = _INVALID if after is None else after
        else:
            # Only a token that starts with a continuation byte (or adds none) can go on from here.
            table = bytearray(b"\xff" * len(vocab))
            for token_id in self._continuing_ids():
                after = walk(state, vocab[token_id])
                if after is not None:
                    table[token_id] = after
        for token_id in self._transparent:
            table[token_id] = state
        self._next[state] = table
        return table

    def _continuing_ids(self) -> list[int]:
        """Tokens whose bytes start with a continuation byte, or that have none."""
        if self._continuing is None:
            vocab = self._vocab
            self._continuing = [i for i, data in enumerate(vocab) if not data or 0x80 <= data[0] <= 0xBF]
        return self._continuing
