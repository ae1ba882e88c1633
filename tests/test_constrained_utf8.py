"""Constrained answers are valid UTF-8 as the client decodes them, whatever the tokenizer.

xgrammar matches bytes and accepts a UTF-16 surrogate written as UTF-8 (`ED A0..BF xx`) as one
character, and byte-level or byte-fallback (`<0xE2>`) tokens can split a character; the client would
then decode U+FFFD where the grammar counted one character and a `maxLength` no longer held. Here the
UTF-8 table is checked on both kinds of vocabulary, then a tiny random model, biased toward the bytes
that break UTF-8, samples a schema with many seeds and every answer must validate, decoded whole and
streamed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import jsonschema
import pytest
import xgrammar as xgr
from conftest import engine_for, tiny_hf_model
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as RustTokenizer
from transformers import PreTrainedTokenizerFast

from decode_service.front_door.choice_text import REPLACEMENT_CHAR, IncrementalDetokenizer
from engine.engine import GenerateRequest
from engine.grammar import GrammarState, control_free_tokens
from engine.params import SamplingParams, StoppingParams
from engine.sequence import FinishReason
from engine.tokenizer import Tokenizer
from engine.utf8_tokens import BOUNDARY, NUM_STATES, Utf8Tokens

# The README's `Weather` (pydantic, `city: str = Field(max_length=20)`) as OpenAI's SDK sends it.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 50},
    },
    "required": ["city", "unit", "temperature"],
    "additionalProperties": False,
}
# SentencePiece-style pieces of the byte-fallback vocabulary, after its 256 `<0xNN>` tokens.
_PIECES = [
    "▁", *"abcdefghijklmnopqrstuvwxyz", *"0123456789", *'{}":,-.', "city", "unit", "celsius",
    "fahrenheit", "temperature", '"city', '":', '","', "▁Paris", "é", "ü", "ř", "你", "好", "😀", "▁the",
]  # fmt: skip


# One byte string that leads to each decoder state, in `engine.utf8_tokens` order.
_PENDING = [b"", b"\xc3", b"\xe4", b"\xe0", b"\xed", b"\xf1", b"\xf0", b"\xf4"]


def byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: SentencePiece pieces, and each byte a `<0xNN>` token for the rest."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in _PIECES:
        vocab.setdefault(piece, len(vocab))
    backend = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens([AddedToken(token, special=True) for token in ("<unk>", "<s>", "</s>")])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    return Tokenizer(hf)


@pytest.fixture(scope="module", params=["byte-level", "byte-fallback"])
def vocabulary(request, tmp_path_factory) -> tuple[Tokenizer, xgr.TokenizerInfo]:
    """The tiny byte-level BPE (SmolLM2's kind) or a byte-fallback SentencePiece vocabulary."""
    if request.param == "byte-level":
        tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
        vocab_size, stop = TINY_VOCAB_SIZE, list(TINY_EOS_TOKEN_IDS)
    else:
        tokenizer = byte_fallback_tokenizer()
        vocab_size, stop = tokenizer.vocab_size, [2]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab_size, stop_token_ids=stop)
    expected = xgr.VocabType.BYTE_LEVEL if request.param == "byte-level" else xgr.VocabType.BYTE_FALLBACK
    assert info.vocab_type == expected
    return tokenizer, info


def byte_ids(info: xgr.TokenizerInfo, data: bytes) -> list[int]:
    """The single-byte tokens spelling `data` (`<0xNN>` in a byte-fallback vocabulary)."""
    by_byte = {token[0]: token_id for token_id, token in enumerate(info.decoded_vocab) if len(token) == 1}
    return [by_byte[byte] for byte in data]


def walk_tokens(utf8: Utf8Tokens, token_ids: Sequence[int]) -> int | None:
    state: int | None = BOUNDARY
    for token_id in token_ids:
        assert state is not None
        state = utf8.advance(state, token_id)
        if state is None:
            return None
    return state


def allows(row, token_id: int) -> bool:
    return bool((int(row[token_id >> 5]) >> (token_id & 31)) & 1)


@pytest.mark.parametrize(
    "data",
    [
        b"\xed\xa0\x80",  # U+D800, a surrogate
        b"\xed\xbf\xbf",  # U+DFFF
        b"\xc0\xaf",  # overlong "/"
        b"\xc1\xbf",
        b"\xe0\x80\xaf",  # overlong, three bytes
        b"\xf0\x80\x80\xaf",  # overlong, four bytes
        b"\xf4\x90\x80\x80",  # past U+10FFFF
        b"\xf5\x80\x80\x80",
        b"\x80",  # a stray continuation byte
        b"\xe4\xbda",  # a character cut by ASCII
        b"\xe4\xe4\xbd\xa0",  # cut by another character's start
    ],
)
def test_bytes_that_break_utf8_are_refused(vocabulary, data):
    _, info = vocabulary
    assert walk_tokens(Utf8Tokens.of(info), byte_ids(info, data)) is None


@pytest.mark.parametrize("text", ["café", "ÿ", "你好", "😀🚀", "\ud7ff\ue000\U0010ffff", "Ångström ř"])
def test_valid_multi_byte_text_is_allowed_byte_by_byte_and_as_the_tokenizer_splits_it(vocabulary, text):
    tokenizer, info = vocabulary
    utf8 = Utf8Tokens.of(info)
    data = text.encode()
    assert walk_tokens(utf8, byte_ids(info, data)) == BOUNDARY
    # Cut inside the last character: the state says which bytes are still due.
    assert walk_tokens(utf8, byte_ids(info, data[:-1])) not in (None, BOUNDARY)
    encoded = tokenizer.hf.encode(text, add_special_tokens=False)
    assert walk_tokens(utf8, encoded) == BOUNDARY


def test_multi_byte_tokens_may_finish_a_character_and_start_the_next(vocabulary):
    _, info = vocabulary
    utf8 = Utf8Tokens.of(info)
    for token_id, token in enumerate(info.decoded_vocab):
        if token_id in info.stop_token_ids:
            continue
        # Every token from every state: allowed exactly when its bytes continue valid UTF-8 from there.
        for state, pending in enumerate(_PENDING):
            expected = _decodes_as_prefix(pending + token)
            assert (utf8.advance(state, token_id) is not None) == expected, (state, token)


def test_each_states_row_allows_exactly_the_tokens_that_advance(vocabulary):
    _, info = vocabulary
    utf8 = Utf8Tokens.of(info)
    for state in range(NUM_STATES):
        row = utf8.row(state)
        for token_id in range(len(info.decoded_vocab)):
            assert allows(row, token_id) == (utf8.advance(state, token_id) is not None), (state, token_id)
        for stop in info.stop_token_ids:  # stop tokens add no text: the grammar alone decides on them
            assert utf8.advance(state, stop) == state


def _decodes_as_prefix(data: bytes) -> bool:
    """Whether `data` is valid UTF-8 or a valid UTF-8 text cut inside its last character."""
    for cut in range(4):
        for tail in (b"\x80", b"\x80\x80", b"\x80\x80\x80", b"\xa0", b"\xa0\x80", b"\x90\x80\x80"):
            try:
                (data + tail[:cut]).decode()
                return True
            except UnicodeDecodeError:
                continue
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def test_the_grammar_mask_refuses_a_surrogate_that_xgrammar_alone_allows(vocabulary):
    _, info = vocabulary
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 5}},
        "required": ["city"],
    }
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(schema), any_whitespace=False
    )
    plain = GrammarState(compiled)
    checked = GrammarState(compiled, utf8=Utf8Tokens.of(info))
    for state in (plain, checked):
        for token_id in byte_ids(info, b'{"city": "\xed'):
            state.accept(token_id)
    [surrogate_byte, valid_byte] = byte_ids(info, b"\xa0\x80")
    masks = {}
    for name, state in (("plain", plain), ("checked", checked)):
        bitmask = xgr.allocate_token_bitmask(1, len(info.decoded_vocab))
        state.fill(bitmask, 0)
        masks[name] = bitmask[0]
    assert allows(masks["plain"], surrogate_byte), "xgrammar itself lets the surrogate through"
    assert not allows(masks["checked"], surrogate_byte)
    assert allows(masks["checked"], valid_byte)


# -- sampled answers -----------------------------------------------------------------------------------


def non_ascii_bias(info: xgr.TokenizerInfo, bias: float) -> dict[int, float]:
    """Push the model toward every token holding a byte past ASCII (lead, continuation, surrogate)."""
    return {i: bias for i, token in enumerate(info.decoded_vocab) if not token.isascii()}


def streamed_text(tokenizer: Tokenizer, prompt: list[int], output: list[int], stopped: bool) -> str:
    """The text as the front door streams it: one token at a time, the stop token's own text left out."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.add(token_id) for token_id in (output[:-1] if stopped else output)]
    return "".join(pieces) + detokenizer.flush()


@pytest.mark.slow
@pytest.mark.parametrize("bias", [0.0, 3.0], ids=["unbiased", "toward-multi-byte"])
def test_sampled_schema_answers_validate_decoded_whole_and_streamed(vocabulary, bias):
    tokenizer, info = vocabulary
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(WEATHER), any_whitespace=False
    )
    control_free, utf8 = control_free_tokens(info), Utf8Tokens.of(info)
    engine = engine_for(tiny_hf_model(3, vocab_size=info.vocab_size), tokenizer=tokenizer)
    prompt = tokenizer.hf.encode("Weather in Paris?")
    logit_bias = non_ascii_bias(info, bias) if bias else {}
    requests = [
        GenerateRequest(
            prompt,
            SamplingParams(temperature=1.0, seed=seed, logit_bias=logit_bias),
            StoppingParams(max_tokens=300),
            grammar=GrammarState(compiled, None, control_free, ("json_schema", "weather"), utf8),
        )
        for seed in range(64)
    ]
    multi_byte = 0
    for seq in engine.generate(requests, max_num_seqs=16):
        assert seq.finish_reason is FinishReason.STOP
        whole = tokenizer.decode(seq.output_token_ids)
        streamed = streamed_text(tokenizer, prompt, seq.output_token_ids, stopped=True)
        for text in (whole, streamed):
            assert REPLACEMENT_CHAR not in text, text
            jsonschema.validate(json.loads(text), WEATHER)
        assert streamed == whole
        multi_byte += not whole.isascii()
    if bias:
        assert multi_byte > 32, "the bias made most answers hold multi-byte characters"
    assert engine.num_free_blocks == engine.num_blocks


# -- the detokenizer -----------------------------------------------------------------------------------

_TEXT_POOL = ["a", "b", "z", " ", "{", '"', "é", "ř", "ж", "€", "你", "好", "😀", "𝄞", "\ufffd", "\U0010ffff"]


def random_token_ids(info: xgr.TokenizerInfo, data: bytes, rng: random.Random) -> list[int]:
    """`data` as tokens cut at random places: any token whose bytes come next may be taken (single bytes
    always exist), so characters are split across tokens in every way the vocabulary allows."""
    by_bytes: dict[bytes, int] = {}
    for token_id, token in enumerate(info.decoded_vocab):
        if token and token_id not in info.stop_token_ids:
            by_bytes.setdefault(token, token_id)
    ids, position = [], 0
    while position < len(data):
        lengths = [n for n in range(1, 9) if data[position : position + n] in by_bytes]
        length = rng.choice(lengths)
        ids.append(by_bytes[data[position : position + length]])
        position += length
    return ids


@pytest.mark.parametrize("by_window", [False, True], ids=["rust-stream", "window"])
def test_the_detokenizer_streams_valid_bytes_as_exactly_their_text(vocabulary, by_window):
    tokenizer, info = vocabulary
    rng = random.Random(5)
    for _ in range(200):
        prompt_text = "".join(rng.choices(_TEXT_POOL, k=rng.randint(0, 6)))
        text = "".join(rng.choices(_TEXT_POOL, k=rng.randint(1, 12))).lstrip(" ") or "x"
        prompt_bytes = prompt_text.encode()
        if rng.random() < 0.3 and prompt_bytes:  # a prompt cut inside its last character
            prompt_bytes = prompt_bytes[: rng.randint(0, len(prompt_bytes) - 1)]
        prompt = random_token_ids(info, prompt_bytes, rng)
        output = random_token_ids(info, text.encode(), rng)
        detokenizer = IncrementalDetokenizer(tokenizer, prompt)
        if by_window:
            detokenizer._step = None  # the path a tokenizer without a Rust decoder takes
        deltas = [detokenizer.add(token_id) for token_id in output]
        assert "".join(deltas) + detokenizer.flush() == text, (prompt, output, deltas)
        assert tokenizer.decode(output) == text
