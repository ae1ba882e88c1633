"""Structured logs of both tiers (`base.logs`): JSON lines that parse, the request id on every line
about a request, and no prompt or completion text unless prompt logging is switched on."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from collections.abc import Iterator

import grpc
import pytest
from conftest import save_tiny_model

from base.logs import (
    JsonFormatter,
    RequestIdFilter,
    TextFormatter,
    bind_request_id,
    log_event,
    set_log_prompts,
    use_log_format,
)
from decode_service.config import DecodeServiceConfig
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.model_store import model_fingerprint
from prefill_service.config import PrefillServiceConfig
from prefill_service.server import MAX_GRPC_MESSAGE_BYTES, PrefillServer
from protos.tandem.internal.v1 import prefill_pb2, prefill_pb2_grpc
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc

SECRET_PROMPT = "the zebra crossing opens at noon"
TIER_LOGGERS = ("serving", "decode_service", "prefill_service")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-logs-model")
    save_tiny_model(directory, 7)
    return directory


def engine_config() -> EngineConfig:
    return EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=64),
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )


class ServerThread:
    """A server built by `factory` on its own event-loop thread."""

    def __init__(self, factory) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server = self.call(self._create(factory))
        self.port = self.call(self.server.start())

    @staticmethod
    async def _create(factory):
        return factory()

    def call(self, coroutine, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def close(self) -> None:
        self.call(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The tiers' INFO lines, formatted as `--log-format json` formats them, collected in a buffer."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    loggers = [logging.getLogger(name) for name in TIER_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    yield buffer
    for logger, level in zip(loggers, levels, strict=True):
        logger.removeHandler(handler)
        logger.setLevel(level)
    set_log_prompts(False)


def parsed(buffer: io.StringIO) -> list[dict]:
    """Every line as JSON (a line that does not parse fails the test)."""
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


@pytest.fixture
def decode(model_dir) -> Iterator[ServerThread]:
    engine = Engine.from_pretrained(model_dir, engine_config())
    config = DecodeServiceConfig(host="127.0.0.1", port=0, max_tokens_cap=32)
    running = ServerThread(lambda: DecodeServer(engine, config))
    yield running
    running.close()


def generate(port: int, request_id: str, max_tokens: int) -> list[pb.GenerateResponse]:
    request = pb.GenerateRequest(
        request_id=request_id,
        prompt=SECRET_PROMPT,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))


def test_decode_json_lines_carry_the_request_id_and_no_prompt_by_default(decode, json_log):
    responses = generate(decode.port, "req-ok", 4)
    with pytest.raises(grpc.RpcError):
        generate(decode.port, "req-too-long", 33)
    completion = "".join(r.text for r in responses)
    entries = [e for e in parsed(json_log) if e["logger"].startswith("decode_service")]

    by_event = {(e.get("event"), e.get("request_id")) for e in entries}
    assert {("request accepted", "req-ok"), ("request finished", "req-ok")} <= by_event
    assert ("request refused", "req-too-long") in by_event
    about_requests = [e for e in entries if e["logger"] == "decode_service.front_door.generation"]
    assert about_requests and all(e.get("request_id") in ("req-ok", "req-too-long") for e in about_requests)
    finished = next(e for e in entries if e.get("event") == "request finished")
    assert finished["finish_reason"] == "length" and finished["completion_tokens"] == 4
    text = json_log.getvalue()
    assert "zebra" not in text
    assert completion.strip() == "" or completion not in text
    assert not any({"prompt", "prompt_token_ids", "completion"} & e.keys() for e in entries)


def test_log_prompts_lets_prompt_and_completion_through(decode, json_log):
    set_log_prompts(True)
    responses = generate(decode.port, "req-logged", 5)
    entries = parsed(json_log)
    accepted = next(e for e in entries if e.get("event") == "request accepted")
    finished = next(e for e in entries if e.get("event") == "request finished")
    assert accepted["prompt"] == SECRET_PROMPT and accepted["prompt_token_ids"]
    assert finished["completion"] == "".join(r.text for r in responses)


def test_prefill_lines_carry_the_request_id_and_no_prompt_ids_by_default(model_dir, json_log):
    engine = Engine.from_pretrained(model_dir, engine_config())
    config = PrefillServiceConfig(host="127.0.0.1", port=0)
    running = ServerThread(lambda: PrefillServer(engine, model_fingerprint(model_dir), config))
    options = [("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_BYTES)]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}", options=options) as channel:
            stub = prefill_pb2_grpc.PrefillStub(channel)
            request = prefill_pb2.PrefillRequest(
                request_id="pre-1",
                prompt_token_ids=[11, 12, 13, 14, 15],
                compatibility_hash=running.server.compatibility_hash,
                sampling=pb.SamplingParams(temperature=0.0),
            )
            list(stub.Prefill(request, timeout=60))
            set_log_prompts(True)
            list(
                stub.Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="pre-2",
                        prompt_token_ids=[21, 22, 23],
                        compatibility_hash=running.server.compatibility_hash,
                        sampling=pb.SamplingParams(temperature=0.0),
                    ),
                    timeout=60,
                )
            )
    finally:
        running.close()
    entries = [e for e in parsed(json_log) if e.get("event", "").startswith("prefill")]
    first = [e for e in entries if e["request_id"] == "pre-1"]
    assert {e["event"] for e in first} == {"prefill accepted", "prefill finished"}
    assert not any("prompt_token_ids" in e for e in first)
    second = next(e for e in entries if e["request_id"] == "pre-2" and e["event"] == "prefill accepted")
    assert second["prompt_token_ids"] == [21, 22, 23]


def test_a_request_id_bound_to_a_task_tags_its_plain_lines_only():
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(TextFormatter())
    handler.addFilter(RequestIdFilter())
    logger = logging.getLogger("tandem.test_logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False

    async def call(request_id: str) -> None:
        bind_request_id(request_id)
        await asyncio.sleep(0)
        logger.info("working on it")
        log_event(logger, logging.INFO, "done", request_id=request_id, tokens=3)

    async def main() -> None:
        await asyncio.gather(call("a-1"), call("b-2"))
        logger.info("between calls")

    try:
        asyncio.run(main())
    finally:
        logger.removeHandler(handler)
        logger.propagate = True
    lines = buffer.getvalue().splitlines()
    assert sum(line.endswith("working on it request_id=a-1") for line in lines) == 1
    assert sum(line.endswith("working on it request_id=b-2") for line in lines) == 1
    # A line that already names its request is not tagged twice; one outside any call is not tagged.
    assert sum(line.endswith("done request_id=a-1 tokens=3") for line in lines) == 1
    assert [line for line in lines if "between calls" in line][0].endswith("between calls")


def test_use_log_format_sets_json_or_text_and_the_filter_once():
    handler = logging.StreamHandler(io.StringIO())
    root = logging.getLogger()
    root.addHandler(handler)
    # use_log_format configures every root handler: give pytest's own ones back untouched afterwards.
    saved = [(h, h.formatter, list(h.filters)) for h in root.handlers]
    try:
        use_log_format("json")
        use_log_format("json")
        assert isinstance(handler.formatter, JsonFormatter)
        assert sum(isinstance(f, RequestIdFilter) for f in handler.filters) == 1
        use_log_format("text")
        assert isinstance(handler.formatter, TextFormatter)
        with pytest.raises(ValueError):
            use_log_format("xml")
    finally:
        root.removeHandler(handler)
        for other, formatter, filters in saved:
            other.setFormatter(formatter)
            other.filters[:] = filters


def test_text_values_with_spaces_are_quoted_so_pairs_stay_splittable(caplog):
    logger = logging.getLogger("tandem.test_logs.quoting")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_event(logger, logging.INFO, "request refused", request_id="r", reason="bad top_p = 2")
    assert caplog.records[0].getMessage() == 'request refused request_id=r reason="bad top_p = 2"'
