"""Each token's own raw bytes, as it adds them to the text: what OpenAI's logprobs `bytes` report.

Decoding one token alone is lossy: a token that holds part of a multi-byte character decodes to U+FFFD,
so the bytes of the tokens of `ř` written in two would come back as two `EF BF BD`. The vocabulary
itself says what each token's bytes are, by how the tokenizer's decoder reads it:
- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each character of the token stands for one byte
  through GPT-2's byte-to-character table;
- byte fallback (sentencepiece models: Llama 2, Mistral, Gemma): `<0xNN>` is the byte NN, and
  the decoder's replacements (`▁` for a space) apply to the other tokens;
- Metaspace: `▁` stands for a space.
Added tokens (control tokens, chat markers) are their text. Any other decoder gets the token's decoded
text, lossy only where it splits characters.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_BYTE_TOKEN_LENGTH = len("<0x00>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's table inverted: the character that stands for each byte → the byte. Printable Latin-1
    bytes stand for themselves; the others are mapped, in order, to the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(byte): byte for byte in kept}
    shifted = 0
    for byte in range(256):
        if byte not in kept:
            table[chr(256 + shifted)] = byte
            shifted += 1
    return table


_BYTE_LEVEL = _byte_level_table()


def _decoder_steps(decoder: dict[str, Any]) -> list[dict[str, Any]]:
    """A decoder's steps, a `Sequence`'s flattened."""
    if decoder.get("type") == "Sequence":
        return [step for inner in decoder.get("decoders", []) for step in _decoder_steps(inner)]
    return [decoder]


class TokenBytes:
    """`token_bytes(token_id)`: that token's bytes, computed on first use and kept (threads that race
    compute the same bytes)."""

    def __init__(self, hf_tokenizer: PreTrainedTokenizerBase) -> None:
        self._hf = hf_tokenizer
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        decoder = backend.decoder if backend is not None else None
        steps = _decoder_steps(json.loads(decoder.__getstate__())) if decoder is not None else []
        kinds = {step.get("type") for step in steps}
        self._byte_level = "ByteLevel" in kinds
        self._byte_fallback = "ByteFallback" in kinds
        self._replacements = [
            (step["pattern"]["String"], step["content"])
            for step in steps
            if step.get("type") == "Replace" and "String" in step.get("pattern", {})
        ]
        self._replacements += [
            (step.get("replacement", "▁"), " ") for step in steps if step.get("type") == "Metaspace"
        ]
        self._known = self._byte_level or self._byte_fallback or bool(self._replacements)
        self._added = {
            token_id: token.content for token_id, token in hf_tokenizer.added_tokens_decoder.items()
        }
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def _compute(self, token_id: int) -> bytes:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        token = self._hf.convert_ids_to_tokens(token_id)
        if not isinstance(token, str) or not self._known:
            return self._hf.decode([token_id], skip_special_tokens=False).encode()
        if self._byte_level and all(char in _BYTE_LEVEL for char in token):
            return bytes(_BYTE_LEVEL[char] for char in token)
        if self._byte_fallback and len(token) == _BYTE_TOKEN_LENGTH and token[:3] + token[5:] == "<0x>":
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        for pattern, content in self._replacements:
            token = token.replace(pattern, content)
        return token.encode()
