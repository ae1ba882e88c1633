"""Logprobs that are not finite still make valid JSON (issue 33, defect 7).

JSON has no NaN or infinity: Starlette's JSONResponse refuses them (the answer became a bare HTTP 500) and
a lenient encoder writes `NaN`, which clients cannot parse. A logprob of -inf goes out as vLLM's -9999.0,
a NaN as null, whole and streamed, on both endpoints.
"""

from __future__ import annotations

import json

import pytest
from fastapi.responses import JSONResponse
from test_openai_protocol import builder, chat, completion, message

from protos.tandem.v1 import generation_pb2 as pb

NAN, INF = float("nan"), float("inf")


def _strict(text: str | bytes) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _messages() -> list[pb.GenerateResponse]:
    first = message(text="Hel", token_ids=[1], logprobs=[(1, NAN)])
    first.logprobs[0].top[1].logprob = -INF
    last = message(text="lo", token_ids=[2], logprobs=[(2, -INF)], finish=pb.STOP, completion_tokens=2)
    return [first, last]


@pytest.mark.parametrize(
    "request_of", [lambda: chat(logprobs=True, top_logprobs=3), lambda: completion(logprobs=3)]
)
def test_non_finite_logprobs_are_sent_as_json_can_carry_them(request_of):
    whole = builder(request_of())
    for response in _messages():
        whole.add(response)
    body = _strict(JSONResponse(whole.body()).body)
    streamed = builder(request_of())
    events = b"".join(streamed.events(response) for response in _messages())
    chunks = [_strict(event.removeprefix(b"data: ")) for event in events.split(b"\n\n") if event]
    logprobs = body["choices"][0]["logprobs"]
    if "content" in logprobs:  # chat
        assert [entry["logprob"] for entry in logprobs["content"]] == [None, -9999.0]
        assert [top["logprob"] for top in logprobs["content"][0]["top_logprobs"]] == [-0.5, -9999.0, -0.5]
        streamed_logprobs = [
            entry["logprob"] for chunk in chunks if chunk["choices"][0]["logprobs"]
            for entry in chunk["choices"][0]["logprobs"]["content"]
        ]  # fmt: skip
    else:
        assert logprobs["token_logprobs"] == [None, -9999.0]
        streamed_logprobs = [
            value for chunk in chunks if chunk["choices"][0]["logprobs"]
            for value in chunk["choices"][0]["logprobs"]["token_logprobs"]
        ]  # fmt: skip
    assert streamed_logprobs == [None, -9999.0]
