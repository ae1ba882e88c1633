"""A reasoning model served end to end: a tiny model whose tokenizer has the think tokens, behind a decode
server with `--reasoning-parser deepseek_r1`. Reasoning goes to `reasoning_text`, never `text`, and a
constraint applies only after `</think>`."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest
from conftest import tiny_hf_model
from test_decode_server import start_server
from tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer
from transformers import AutoTokenizer

from protos.tandem.v1 import generation_pb2 as pb

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}


# ChatML, and Qwen3's switch: with enable_thinking false the generation prompt holds an empty think block.
THINKING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = build_tiny_tokenizer(tmp_path_factory.mktemp("reasoning-model"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(directory)
    tiny_hf_model(3, vocab_size=TINY_VOCAB_SIZE + 2).save_pretrained(directory)
    running = start_server(directory, max_model_len=512, num_blocks=128, reasoning_parser="deepseek_r1")
    yield running, tokenizer.convert_tokens_to_ids("</think>")
    running.close()


def chat(**kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.ChatMessage(role="user", content="Think, then answer.")],
        sampling=pb.SamplingParams(temperature=0.0, **kwargs.pop("sampling", {})),
        stopping=pb.StoppingParams(max_tokens=40),
        **kwargs,
    )


def test_text_before_the_end_of_reasoning_is_reasoning(server):
    running, think_end = server
    responses = list(running.stub.Generate(chat(sampling={"logit_bias": {think_end: -100.0}}), timeout=60))
    ids = [token_id for response in responses for token_id in response.token_ids]
    reasoning = "".join(response.reasoning_text for response in responses)
    assert think_end not in ids and len(ids) == 40
    assert reasoning == running.engine.tokenizer.decode(ids)
    assert not any(response.text for response in responses)


def test_a_schema_applies_after_the_reasoning_ends(server):
    running, think_end = server
    request = chat(
        sampling={"logit_bias": {think_end: 100.0}},
        structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
    )
    responses = list(running.stub.Generate(request, timeout=60))
    ids = [token_id for response in responses for token_id in response.token_ids]
    assert ids[0] == think_end, "the grammar must not hold back the reasoning's end"
    text = "".join(response.text for response in responses)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "".join(response.reasoning_text for response in responses) == ""
    assert responses[-1].finish_reason == pb.STOP


def test_a_prompt_that_closes_the_reasoning_starts_the_schema_at_once(server):
    running, think_end = server
    request = chat(
        structured_output=pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
        chat_template_kwargs_json=json.dumps({"enable_thinking": False}),
    )
    responses = list(running.stub.Generate(request, timeout=60))
    ids = [token_id for response in responses for token_id in response.token_ids]
    assert think_end not in ids
    jsonschema.validate(json.loads(running.engine.tokenizer.decode(ids)), SCHEMA)
    assert responses[-1].finish_reason == pb.STOP


@pytest.mark.parametrize(
    ("kwargs_json", "needle"),
    [("[1]", "must be a JSON object"), ('{"tools": []}', "must not set tools"), ("{", "is not valid JSON")],
)
def test_bad_chat_template_kwargs_are_refused_naming_the_field(server, kwargs_json, needle):
    running, _ = server
    with pytest.raises(grpc.RpcError) as caught:
        list(running.stub.Generate(chat(chat_template_kwargs_json=kwargs_json), timeout=60))
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert (
        caught.value.details().startswith("chat_template_kwargs_json: ") and needle in caught.value.details()
    )


def test_special_tokens_stay_in_the_text_when_asked(server):
    running, _ = server
    special = running.engine.tokenizer.hf.convert_tokens_to_ids("<|im_start|>")
    texts = {}
    for skip in (True, False):
        request = chat(sampling={"logit_bias": {special: 100.0}}, skip_special_tokens=skip)
        responses = list(running.stub.Generate(request, timeout=60))
        assert all(token_id == special for r in responses for token_id in r.token_ids)
        texts[skip] = "".join(r.reasoning_text + r.text for r in responses)
    assert texts[True] == "" and texts[False] == "<|im_start|>" * 40
