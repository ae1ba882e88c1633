"""The round-5 audit's cheap constrained request that stalled every step, on a live `DecodeServer`.

An ambiguous grammar compiles in milliseconds, but its token masks take longer to fill the more text it
has: here it ends with INVALID_ARGUMENT naming its field (refused on the probe after its compile, or
ended in the step once its fills pass `--structured-output-fill-timeout-ms`), while another tenant's
streams run beside it to their last token and the server keeps serving.

Both outcomes hold at any machine speed: the fills grow without bound with the text, so a faster
machine only reaches the limit a few tokens later, well within `max_tokens`.
"""

from __future__ import annotations

import grpc
import pytest
from conftest import save_tiny_model, wait_until
from test_decode_server import RunningServer, start_server
from tiny_tokenizer import TINY_EOS_TOKEN_IDS

from decode_service.engine_core import fill_vetting
from protos.tandem.v1 import generation_pb2 as pb

FILL_LIMIT_MS = 20.0
AMBIGUOUS = {
    "ebnf": pb.StructuredOutput(grammar="root ::= x\nx ::= [a-z] | [a-z] x | x [a-z] | x x"),
    "regex": pb.StructuredOutput(regex="(([a-z]*)*[a-z]*)*"),
}
FIELDS = {"ebnf": "structured_output.grammar", "regex": "structured_output.regex"}
PLAIN_TOKENS = 150


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-model")
    save_tiny_model(directory, 7)
    running = start_server(
        directory,
        max_num_seqs=16,
        max_model_len=1024,
        num_blocks=512,
        structured_output_fill_timeout_ms=FILL_LIMIT_MS,
    )
    yield running
    running.close()


def ambiguous(output: pb.StructuredOutput, n: int = 4) -> pb.GenerateRequest:
    """The grammar alone decides when its answer ends; EOS biased away, so only the limit can end it."""
    no_eos = {token_id: -100.0 for token_id in TINY_EOS_TOKEN_IDS}
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Write letters.")],
        sampling=pb.SamplingParams(temperature=1.0, seed=3, logit_bias=no_eos),
        stopping=pb.StoppingParams(max_tokens=600),
        structured_output=output,
        n=n,
        tenant="ambiguous",
    )


def plain_streams(server: RunningServer, count: int = 3) -> list[tuple[pb.GenerateResponse, object]]:
    """Another tenant's streams, each running (its first response read) before the ambiguous request."""
    request = pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Tell me a story.")],
        sampling=pb.SamplingParams(temperature=1.0, seed=9),
        stopping=pb.StoppingParams(max_tokens=PLAIN_TOKENS, ignore_eos=True),
        tenant="other",
    )
    streams = [server.stub.Generate(request, timeout=300) for _ in range(count)]
    return [(next(stream), stream) for stream in streams]


def assert_streams_completed(streams) -> None:
    for first, stream in streams:
        responses = [first, *stream]
        assert responses[-1].finish_reason == pb.LENGTH
        assert sum(len(response.token_ids) for response in responses) == PLAIN_TOKENS


def refusal(server: RunningServer, request: pb.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        list(server.stub.Generate(request, timeout=300))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    return caught.value


@pytest.mark.parametrize("kind", list(AMBIGUOUS))
def test_an_ambiguous_constraint_ends_alone_and_other_tenants_keep_streaming(server, kind):
    streams = plain_streams(server)
    details = refusal(server, ambiguous(AMBIGUOUS[kind])).details()
    assert details.startswith(f"{FIELDS[kind]}: the constraint's token mask took "), details
    assert "--structured-output-fill-timeout-ms" in details
    assert_streams_completed(streams)
    assert "--structured-output-fill-timeout-ms" in refusal(server, ambiguous(AMBIGUOUS[kind], n=1)).details()
    assert wait_until(server.pool_is_full, timeout=10), "an ended request still holds KV blocks"


@pytest.mark.parametrize("kind", list(AMBIGUOUS))
def test_past_the_probe_the_step_ends_it_once_its_fills_outgrow_the_limit(server, kind, monkeypatch):
    """With no probe the grammar runs: its n = 4 choices' fills grow token by token until one step's
    pass the limit, and that step ends the request (all four choices) with its own error."""
    monkeypatch.setattr(fill_vetting, "PROBE_TOKENS", 0)
    output = pb.StructuredOutput()
    output.CopyFrom(AMBIGUOUS[kind])
    # A spec of its own (one more space), so that this grammar, cached once it passed, is not the refusal
    # test's.
    if kind == "ebnf":
        output.grammar += " "
    else:
        output.regex = f"({output.regex})"
    streams = plain_streams(server)
    details = refusal(server, ambiguous(output)).details()
    assert details.startswith(f"{FIELDS[kind]}: the constraint's token mask took "), details
    assert "to compute for one token" in details and f"limit of {FILL_LIMIT_MS:g} ms" in details
    assert_streams_completed(streams)
    assert wait_until(server.pool_is_full, timeout=10), "an ended request still holds KV blocks"


def test_the_fill_limit_flag_reaches_the_core_and_must_be_positive():
    import argparse

    from base.errors import ConfigError
    from decode_service.cli import add_arguments, service_config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def limit(*flags: str) -> float:
        config = service_config_from_args(parser.parse_args(["--model", "m", *flags]))
        return config.core.grammar.structured_output_fill_timeout_ms

    assert limit() == 1000.0
    assert limit("--structured-output-fill-timeout-ms", "250") == 250.0
    with pytest.raises(ConfigError, match="structured_output_fill_timeout_ms must be > 0"):
        limit("--structured-output-fill-timeout-ms", "0")
