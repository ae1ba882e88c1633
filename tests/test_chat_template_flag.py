"""A model without a chat template (a base model such as Gemma 3 270M) and the `--chat-template` flag.

Its chat endpoints answer a clear 400 / INVALID_ARGUMENT naming the flag, and the server goes on serving
everything else; completions always work; `--chat-template`, a Jinja file or the template text itself,
gives it chat. Served on the tiny model with its template removed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import grpc
import pytest
from conftest import save_tiny_model
from test_openai_api import MODEL, Server, http_call

from base.errors import ConfigError
from decode_service.chat_template import read_chat_template
from protos.tandem.v1 import generation_pb2 as pb
from tandem.client.generate_command import NO_CHAT_TEMPLATE

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 3, "temperature": 0}
# A template unlike the model's own, so a chat it renders shows that the flag's template was used.
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def strip_chat_template(model_dir: Path) -> None:
    """Make the tiny model's tokenizer files look like a base model's: no chat template anywhere."""
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-base-model")
    save_tiny_model(directory, 23)
    strip_chat_template(directory)
    return directory


# --- the flag's value -----------------------------------------------------------------------------


def test_a_flag_naming_a_file_reads_it(tmp_path: Path):
    path = tmp_path / "t.jinja"
    path.write_text(PLAIN_TEMPLATE)
    assert read_chat_template(str(path)) == PLAIN_TEMPLATE


def test_a_flag_holding_jinja_is_the_template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    assert read_chat_template(PLAIN_TEMPLATE) == PLAIN_TEMPLATE
    long_inline = "{{ messages[0]['content'] }}" + " " * 5000
    assert read_chat_template(long_inline) == long_inline


@pytest.mark.parametrize("value", ["/nonexistent/t.jinja", "chatml", ""])
def test_a_flag_that_is_neither_file_nor_template_is_refused(value: str):
    with pytest.raises(ConfigError, match="is not a readable file, nor an inline Jinja template"):
        read_chat_template(value)


def test_decode_flag_takes_an_inline_template():
    from decode_service.cli import add_arguments, service_config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = service_config_from_args(parser.parse_args(["--model", "m", "--chat-template", PLAIN_TEMPLATE]))
    assert config.chat_template == PLAIN_TEMPLATE


def test_up_passes_the_chat_template_to_the_decode_tier_only(tmp_path: Path):
    from tandem.up import add_arguments, tier_specs

    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level", default="info")
    add_arguments(parser)
    prefill, decode = tier_specs(parser.parse_args(["--chat-template", PLAIN_TEMPLATE]), tmp_path)
    assert "--chat-template" not in prefill.argv
    flag = decode.argv.index("--chat-template")
    assert decode.argv[flag + 1] == PLAIN_TEMPLATE
    assert all("--chat-template" not in spec.argv for spec in tier_specs(parser.parse_args([]), tmp_path))


# --- serving a model without a template -------------------------------------------------------------


@pytest.mark.slow
def test_chat_without_a_template_is_a_clear_400_and_the_server_keeps_serving(base_model_dir: Path):
    server = Server(base_model_dir)
    try:
        status, body = http_call(server, "POST", "/v1/chat/completions", CHAT)
        assert status == 400, body
        message = body["error"]["message"]
        assert "this model has no chat template" in message and "--chat-template" in message

        chat = pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="hi")], stopping=pb.StoppingParams(max_tokens=3)
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(server.stub.Generate(chat, timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details()
        assert "no chat template" in details and "--chat-template" in details
        assert NO_CHAT_TEMPLATE in details, "`tandem generate` falls back to a raw prompt on it"

        status, body = http_call(server, "POST", "/v1/completions", COMPLETION)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 3
        prompt = pb.GenerateRequest(prompt="the quick brown fox", stopping=pb.StoppingParams(max_tokens=3))
        final = list(server.stub.Generate(prompt, timeout=60))[-1]
        assert final.usage.completion_tokens == 3
        assert server.idle()
    finally:
        server.close()


@pytest.mark.slow
@pytest.mark.parametrize("as_file", [False, True], ids=["inline", "file"])
def test_chat_with_the_flag_renders_the_given_template(base_model_dir: Path, tmp_path: Path, as_file: bool):
    value = PLAIN_TEMPLATE
    if as_file:
        path = tmp_path / "plain.jinja"
        path.write_text(PLAIN_TEMPLATE)
        value = str(path)
    server = Server(base_model_dir, chat_template=value)
    try:
        status, body = http_call(server, "POST", "/v1/chat/completions", CHAT)
        assert status == 200, body
        assert body["choices"][0]["message"]["role"] == "assistant"
        rendered = server.engine.tokenizer.encode("user: hi\nassistant:")
        assert body["usage"]["prompt_tokens"] == len(rendered)
    finally:
        server.close()
