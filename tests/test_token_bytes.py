"""Each token's own bytes, as chat logprobs report them: a character split across tokens comes back as its
UTF-8 pieces (never EF BF BD), so the bytes of an answer's tokens put together are its text's UTF-8, for
byte-level BPE, byte-fallback and Metaspace vocabularies alike."""

from __future__ import annotations

from tiny_tokenizer import build_tiny_tokenizer
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from decode_service.front_door.openai_http.protocol import Endpoint, translate
from decode_service.front_door.openai_http.responses import ResponseBuilder
from engine.token_bytes import TokenBytes
from engine.tokenizer import Tokenizer
from protos.tandem.v1 import generation_pb2 as pb

TEXT = "Hello wörld: řřřř, 東京 😀"


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A sentencepiece-style vocabulary (Llama 2, Mistral): `▁` for spaces, `<0xNN>` for bytes it lacks."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    for piece in ("▁", "H", "e", "l", "o", "w", "r", "d", ":", ",", "▁Hello", "ld"):
        vocab.setdefault(piece, len(vocab))
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    rust.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=rust, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<unk>": 0, "▁Hello": 1, "▁w": 2, "ö": 3, "r": 4, "l": 5, "d": 6, "▁": 7}
    rust = RustTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=rust, unk_token="<unk>")


def token_pieces(hf, text: str) -> list[bytes]:
    token_bytes = TokenBytes(hf)
    return [token_bytes(token_id) for token_id in hf.encode(text, add_special_tokens=False)]


def test_byte_level_tokens_are_their_bytes_even_mid_character(tmp_path):
    hf = AutoTokenizer.from_pretrained(build_tiny_tokenizer(tmp_path))
    pieces = token_pieces(hf, TEXT)
    assert b"".join(pieces) == TEXT.encode()
    assert b"\xef\xbf\xbd" not in b"".join(pieces)
    split = [piece for piece in pieces if piece.decode(errors="replace") != piece.decode(errors="ignore")]
    assert split, "the tiny vocabulary splits some characters between tokens"
    assert TokenBytes(hf)(hf.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"


def test_byte_fallback_tokens_are_their_byte_and_pieces_their_text():
    hf = byte_fallback_tokenizer()
    ids = hf.encode("Hello wörld ř", add_special_tokens=False)
    assert "<0xC5>" in hf.convert_ids_to_tokens(ids)
    assert b"".join(token_pieces(hf, "Hello wörld ř")) == " Hello wörld ř".encode()
    assert TokenBytes(hf)(hf.convert_tokens_to_ids("<0xC5>")) == b"\xc5"


def test_metaspace_pieces_stand_for_spaces():
    hf = metaspace_tokenizer()
    token_bytes = TokenBytes(hf)
    pieces = ["▁Hello", "▁w", "ö", "r", "▁"]
    assert [token_bytes(hf.convert_tokens_to_ids(piece)) for piece in pieces] == [
        b" Hello",
        b" w",
        "ö".encode(),
        b"r",
        b" ",
    ]


def test_chat_logprobs_bytes_are_each_tokens_own_bytes(tmp_path):
    tokenizer = Tokenizer.from_pretrained(build_tiny_tokenizer(tmp_path))
    ids = tokenizer.encode("řřřř")
    assert len(ids) > 4, "each ř is two tokens"
    request = translate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1},
        Endpoint.CHAT,
    )
    builder = ResponseBuilder(
        request,
        "r",
        "m",
        lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False),
        token_bytes=tokenizer.token_bytes,
    )
    response = pb.GenerateResponse(request_id="r", text="řřřř", token_ids=ids, finish_reason=pb.STOP)
    for token_id in ids:
        response.logprobs.add(
            token_id=token_id, logprob=-0.5, top=[pb.TopLogprob(token_id=token_id, logprob=-0.5)]
        )
    builder.add(response)
    (choice,) = builder.body()["choices"]
    content = choice["logprobs"]["content"]
    assert choice["message"]["content"] == "řřřř"
    assert bytes(b for entry in content for b in entry["bytes"]) == "řřřř".encode()
    assert [entry["bytes"] for entry in content] == [entry["top_logprobs"][0]["bytes"] for entry in content]
    assert content[0]["bytes"] == [0xC5] and content[0]["token"] == "\ufffd"
