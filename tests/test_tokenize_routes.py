"""vLLM's `/tokenize` and `/detokenize` on a live server with the real default model: held-out texts
round-trip, a prompt's and a chat's counts are the prompt tokens the generation routes report for the
same prompt, and every field sent wrong gets a 400 naming it while the server keeps serving."""

from __future__ import annotations

import pytest
from conftest import wait_until
from test_openai_api import MODEL, Server, http_call

from bench.heldout_text import heldout_prompts

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server(real_model_dir):
    running = Server(real_model_dir, max_model_len=1024)
    yield running
    running.close()


def post(server: Server, path: str, body: object) -> tuple[int, dict]:
    return http_call(server, "POST", path, body)


def tokenize(server: Server, body: dict) -> dict:
    status, answer = post(server, "/tokenize", body)
    assert status == 200, answer
    return answer


def test_heldout_texts_round_trip_and_count_as_the_completions_route_counts(server):
    words = lambda text: len(text.split())  # noqa: E731
    for prompt in heldout_prompts([12, 100, 250], words):
        answer = tokenize(server, {"model": MODEL, "prompt": prompt})
        assert answer["count"] == len(answer["tokens"]) > 0 and answer["max_model_len"] == 1024
        status, text = post(server, "/detokenize", {"model": MODEL, "tokens": answer["tokens"]})
        assert status == 200 and text == {"prompt": prompt}
        used = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        assert used.usage.prompt_tokens == answer["count"]
    assert tokenize(server, {"prompt": "x", "add_special_tokens": True})["count"] >= 1


def test_a_chat_counts_as_the_chat_route_renders_it(server):
    answer = tokenize(server, {"messages": CHAT, "add_generation_prompt": True})
    used = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0)
    assert answer["count"] == used.usage.prompt_tokens == len(answer["tokens"])
    status, text = post(server, "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200 and "Name three rivers." in text["prompt"]
    with_tools = tokenize(server, {"messages": CHAT, "tools": TOOLS})
    assert with_tools["count"] >= answer["count"]


BAD = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "a", "tools": TOOLS}, "tools"),
    ("/tokenize", {"prompt": "a", "model": 1}, "model"),
    ("/tokenize", {"prompt": "a", "return_token_strs": True}, "return_token_strs"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1, 2**40]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p}-{param}" for p, _, param in BAD])
def test_each_field_sent_wrong_is_refused_naming_it(server, path, body, param):
    status, answer = post(server, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert error["message"].startswith(param) and error["type"] == "invalid_request_error", error
    assert tokenize(server, {"prompt": "still serving"})["count"] > 0


def test_the_model_key_and_body_limits_apply(server):
    status, answer = post(server, "/tokenize", {"model": "other", "prompt": "a"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    status, answer = post(server, "/detokenize", b"[1, 2")
    assert status == 400 and answer["error"]["param"] == "body"
    status, answer = post(server, "/tokenize", b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert status == 413
    schema = http_call(server, "GET", "/openapi.json")[1]
    for path in ("/tokenize", "/detokenize", "/v1/messages", "/v1/messages/count_tokens"):
        assert "$ref" in schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert wait_until(server.idle)
