"""Every command line and client snippet the README shows that calls a server runs, as printed, against a
live decode server (gRPC and HTTP); only `localhost:50051` / `localhost:8000` are pointed at its ports."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_until
from test_openai_api import Server

from tandem.client.connection import ROUND_ROBIN_SERVICE_CONFIG

README = Path(__file__).resolve().parents[1] / "README.md"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^[ \t]*```{language}\n(.*?)^[ \t]*```", README.read_text(), re.MULTILINE | re.DOTALL)


def command_lines(prefixes: tuple[str, ...]) -> list[str]:
    """The README's shell command lines starting with one of `prefixes` (continuation lines joined)."""
    lines = []
    for block in code_blocks("bash"):
        for command in re.sub(r"\\\n\s*", "", block).splitlines():
            if command.startswith(prefixes):
                lines.append(command)
    return lines


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import save_tiny_model

    directory = tmp_path_factory.mktemp("readme-model")
    save_tiny_model(directory, 3)
    running = Server(directory)
    yield running
    running.close()


def localize(text: str, server: Server) -> str:
    return text.replace("localhost:50051", f"127.0.0.1:{server.server.port}").replace(
        "localhost:8000", f"127.0.0.1:{server.server.http_port}"
    )


@pytest.mark.slow
def test_every_generate_and_curl_line_of_the_readme_runs(server):
    generate = command_lines(("tandem generate",))
    curl = command_lines(("curl ",))
    assert len(generate) >= 3 and len(curl) >= 3
    env = {**os.environ, "TANDEM_TARGET": f"127.0.0.1:{server.server.port}"}
    tandem = str(Path(sys.executable).with_name("tandem"))
    for line in generate:
        command = tandem + line.removeprefix("tandem")
        result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=180)
        assert result.returncode == 0, f"{line}\n{result.stderr}"
        assert "finish:" in result.stderr, f"{line}\n{result.stderr}"
    assert shutil.which("curl"), "curl is needed to run the README's HTTP examples"
    for line in curl:
        result = subprocess.run(
            ["bash", "-c", localize(line, server)], capture_output=True, text=True, timeout=180
        )
        assert result.returncode == 0, f"{line}\n{result.stderr}"
        # A Responses API object always carries `"error": null`; an error is an object or event.
        failed = re.search(r'"error":\s*\{|event: error', result.stdout)
        assert failed is None and result.stdout.strip(), f"{line}\n{result.stdout}"
    assert wait_until(server.idle)


@pytest.mark.slow
def test_the_readme_client_snippets_run(server):
    snippets = [b for b in code_blocks("python") if "TandemClient(" in b or "OpenAI(" in b]
    assert len(snippets) == 3
    for snippet in snippets:
        # The tiny random model samples its end of text first now and then (an empty answer): not here.
        runnable = localize(snippet, server).replace(
            "stream=True", 'stream=True, extra_body={"ignore_eos": True}'
        )
        result = subprocess.run([sys.executable, "-c", runnable], capture_output=True, text=True, timeout=180)
        assert result.returncode == 0, f"{snippet}\n{result.stderr}"
        assert result.stdout.strip()


def test_the_readme_service_config_is_the_one_the_client_uses():
    (config,) = [json.loads(block) for block in code_blocks("json") if "round_robin" in block]
    assert config == ROUND_ROBIN_SERVICE_CONFIG
