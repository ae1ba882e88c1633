"""The client and `tandem generate` against a real `DecodeServer` on a tiny random model saved to disk.

Checks that the client's view of the real wire agrees with the model: greedy output equals the
Hugging Face reference, sync equals async, Abort ends a live stream, server errors arrive typed.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
from conftest import hf_greedy, tiny_hf_model
from tiny_tokenizer import TINY_EOS_TOKEN_IDS, TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.config import DecodeServiceConfig
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from tandem.cli import main
from tandem.client import AsyncTandemClient, FinishReason, InvalidArgument, ServingMode, TandemClient

SAFETY_TIMEOUT = 60.0
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(21, vocab_size=TINY_VOCAB_SIZE)


@pytest.fixture(scope="module")
def target(tmp_path_factory, hf_model):
    """A decode server on 127.0.0.1 (its own event-loop thread) over the tiny model; yields host:port."""
    model_dir = tmp_path_factory.mktemp("tiny-model")
    hf_model.save_pretrained(model_dir)
    build_tiny_tokenizer(model_dir)
    engine_config = EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=128),
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    engine = Engine.from_pretrained(model_dir, engine_config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(SAFETY_TIMEOUT)

    async def create() -> DecodeServer:
        return DecodeServer(engine, DecodeServiceConfig(host="127.0.0.1", port=0))

    server = call(create())
    port = call(server.start())
    yield f"127.0.0.1:{port}"
    call(server.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(SAFETY_TIMEOUT)
    loop.close()


@pytest.fixture
def client(target):
    with TandemClient(target, timeout=SAFETY_TIMEOUT) as tandem_client:
        yield tandem_client


PROMPT = [5, 17, 99, 200, 31]
GREEDY = dict(temperature=0.0, ignore_eos=True, max_tokens=8)


def test_greedy_completion_matches_hf_and_async_agrees(client, target, hf_model):
    completion = client.complete(token_ids=PROMPT, **GREEDY)
    assert list(completion.token_ids) == hf_greedy(hf_model, PROMPT, 8)
    assert completion.finish_reason is FinishReason.LENGTH
    assert completion.usage.prompt_tokens == len(PROMPT) and completion.usage.completion_tokens == 8
    assert completion.timings.first_token_seconds > 0

    async def run_async():
        async with AsyncTandemClient(target, timeout=SAFETY_TIMEOUT) as async_client:
            stream = async_client.generate(token_ids=PROMPT, request_id="a", **GREEDY)
            return [delta async for delta in stream]

    sync_deltas = list(client.generate(token_ids=PROMPT, request_id="a", **GREEDY))
    async_deltas = asyncio.run(run_async())

    # Timings, and how tokens group into messages, differ between two runs; what the model decides must not.
    def decided(deltas) -> tuple:
        tokens = [t for d in deltas for t in d.token_ids]
        return tokens, "".join(d.text for d in deltas), deltas[-1].finish_reason, deltas[-1].usage

    assert decided(sync_deltas) == decided(async_deltas)
    assert decided(sync_deltas)[0] == list(completion.token_ids)


def test_text_and_chat_prompts(client):
    options = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    text = client.complete("Hello, world!", **options)
    chat = client.complete(messages=[("user", "Hello, world!")], **options)
    assert len(text.token_ids) == len(chat.token_ids) == 4
    assert chat.usage.prompt_tokens > text.usage.prompt_tokens, "the chat template adds tokens"


def test_abort_ends_a_live_stream(client):
    stream = client.generate(
        token_ids=[3, 4, 5], request_id="real-abort", temperature=0.0, ignore_eos=True, max_tokens=200
    )
    next(stream)
    assert client.abort("real-abort")
    assert list(stream)[-1].finish_reason is FinishReason.ABORT


def test_invalid_argument_carries_the_server_message(client):
    with pytest.raises(InvalidArgument) as raised:
        client.complete(token_ids=PROMPT, temperature=-1.0)
    assert "temperature" in raised.value.message


def test_model_info_and_health(client):
    info = client.model_info()
    assert info.vocab_size == TINY_VOCAB_SIZE and info.max_context_length == MAX_MODEL_LEN
    assert set(info.eos_token_ids) == set(TINY_EOS_TOKEN_IDS) and info.mode is ServingMode.AGGREGATED
    assert client.health() == "SERVING"


def test_tandem_generate_streams_from_the_real_server(target, hf_model, capsys):
    code = main(
        [
            "generate",
            "--token-ids",
            ",".join(map(str, PROMPT)),
            "--target",
            target,
            "--json",
            "--temperature",
            "0",
            "--ignore-eos",
            "--max-tokens",
            "8",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    messages = [json.loads(line) for line in out.splitlines()]
    assert [t for m in messages for t in m.get("tokenIds", [])] == hf_greedy(hf_model, PROMPT, 8)
    assert messages[-1]["finishReason"] == "LENGTH"
