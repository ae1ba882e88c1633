"""`tandem up`: the thread split, the children's command lines, the how-to-call lines, the status
line, and the real thing as a subprocess on a tiny model (serves, `tandem generate` streams, SIGINT
stops everything, a dead tier takes the other down with a telling exit status)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import free_ports, save_tiny_model
from google.protobuf import json_format
from prometheus_client.parser import text_string_to_metric_families

from decode_service.front_door.openai_http.protocol import Endpoint, translate
from protos.tandem.v1 import generation_pb2 as pb
from tandem.cli import build_parser
from tandem.client import TandemClient
from tandem.up import (
    EXIT_DECODE_EXITED,
    EXIT_OK,
    EXIT_PREFILL_EXITED,
    EXIT_STARTUP_FAILED,
    check_ports,
    decode_target,
    has_chat_template,
    how_to_call,
    split_threads,
    tier_specs,
)
from tandem.up import run as run_up
from tandem.up_status import StatusLine, merge_replicas

START_TIMEOUT_S = 180


@pytest.mark.parametrize(
    ("total", "expected"), [(1, (1, 1)), (2, (1, 1)), (3, (1, 2)), (4, (2, 2)), (16, (8, 8)), (48, (8, 40))]
)
def test_threads_split_decode_half_capped_prefill_the_rest(total, expected):
    decode, prefill = split_threads(total)
    assert (decode, prefill) == expected
    assert decode + prefill == max(total, 2)


def test_children_get_their_ports_threads_shared_sizing_and_extra_flags_last():
    args = build_parser().parse_args(
        [
            "up",
            "--model",
            "/models/m",
            "--threads",
            "4",
            "--block-size",
            "8",
            "--port",
            "7001",
            "--prefill-port",
            "7002",
            "--metrics-port",
            "0",
            "--log-format",
            "json",
            "--log-prompts",
            "--decode-args",
            "--max-num-seqs 4 --threads 3",
        ]
    )
    prefill, decode = tier_specs(args, Path("/models/m"))
    assert (prefill.name, prefill.port, prefill.threads) == ("prefill", 7002, 2)
    assert (decode.name, decode.port, decode.threads) == ("decode", 7001, 2)
    assert prefill.argv[prefill.argv.index("serve") + 1] == "prefill"
    assert decode.argv[decode.argv.index("serve") + 1] == "decode"
    for spec in (prefill, decode):
        flags = spec.argv
        assert flags[flags.index("--block-size") + 1] == "8"
        assert flags[flags.index("--log-format") + 1] == "json" and "--log-prompts" in flags
        assert "--dtype" not in flags and "--kv-cache-memory" not in flags
    assert decode.argv[decode.argv.index("--prefill") + 1] == "127.0.0.1:7002"
    assert decode.argv[decode.argv.index("--metrics-port") + 1] == "0"
    assert decode.argv[decode.argv.index("--http-port") + 1] == "8000" and "--http-port" not in prefill.argv
    assert decode.argv[-4:] == ["--max-num-seqs", "4", "--threads", "3"]
    assert "--speculative" not in decode.argv


def test_speculative_decoding_reaches_the_decode_tier_only():
    args = build_parser().parse_args(["up", "--speculative", "ngram", "--num-speculative-tokens", "2"])
    prefill, decode = tier_specs(args, Path("/models/m"))
    assert decode.argv[decode.argv.index("--speculative") + 1] == "ngram"
    assert decode.argv[decode.argv.index("--num-speculative-tokens") + 1] == "2"
    assert "--speculative" not in prefill.argv


def test_decode_replicas_share_one_prefill_tier_on_strided_ports_and_split_the_decode_threads():
    args = build_parser().parse_args(
        ["up", "--decode-replicas", "3", "--threads", "8", "--port", "7001", "--prefill-port", "7002"]
    )
    prefill, *decodes = tier_specs(args, Path("/models/m"))
    assert [(d.name, d.role, d.port, d.threads) for d in decodes] == [
        ("decode-0", "decode", 7001, 1),
        ("decode-1", "decode", 7011, 1),
        ("decode-2", "decode", 7021, 1),
    ]
    for index, decode in enumerate(decodes):
        flags = decode.argv
        assert flags[flags.index("--prefill") + 1] == "127.0.0.1:7002"
        assert flags[flags.index("--http-port") + 1] == str(8000 + 10 * index)
        assert flags[flags.index("--metrics-port") + 1] == str(9400 + 10 * index)
    assert prefill.role == "prefill" and prefill.threads == 4
    assert decode_target(args) == "ipv4:127.0.0.1:7001,127.0.0.1:7011,127.0.0.1:7021"
    single = build_parser().parse_args(["up", "--port", "7001"])
    assert decode_target(single) == "127.0.0.1:7001" and [s.name for s in tier_specs(single, Path("/m"))] == [
        "prefill",
        "decode",
    ]


def test_ports_two_children_would_share_are_refused_before_anything_starts(capsys):
    args = build_parser().parse_args(
        ["up", "--decode-replicas", "2", "--port", "50042", "--prefill-port", "50052"]
    )
    with pytest.raises(ValueError, match=r"port 50052 would be used twice"):
        check_ports(args)
    assert run_up(args) == EXIT_STARTUP_FAILED
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--decode-replicas", "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_several_replicas_are_shown_as_one_target_with_an_affinity_client():
    text = how_to_call("0.0.0.0", 7001, 8001, "SmolLM2", replicas_target="ipv4:127.0.0.1:7001,127.0.0.1:7011")
    assert "tandem generate --target ipv4:127.0.0.1:7001,127.0.0.1:7011" in text
    sdk = re.search(r"python -c '(from tandem\.client .+)'$", text, re.MULTILINE)
    assert sdk is not None and "affinity=True" in sdk.group(1)
    compile(sdk.group(1), "client-example", "exec")
    assert "grpcurl -plaintext -d" in text and text.endswith("Ctrl-C stops every tier.")


def test_the_status_line_sums_replicas_and_averages_their_kv_usage():
    one = {
        "tandem:num_requests_running": 2,
        "tandem:kv_cache_usage_perc": 0.2,
        "tandem:generation_tokens_total": 5,
    }
    two = {
        "tandem:num_requests_running": 1,
        "tandem:kv_cache_usage_perc": 0.4,
        "tandem:generation_tokens_total": 7,
    }
    merged = merge_replicas([one, two])
    assert merged["tandem:num_requests_running"] == 3 and merged["tandem:generation_tokens_total"] == 12
    assert merged["tandem:kv_cache_usage_perc"] == pytest.approx(0.3)
    assert merge_replicas([one, {}]) == {}


def test_a_base_model_is_shown_completions_not_chat(tmp_path):
    """A model without a chat template (Gemma 3 270M) answers chat with 400: the banner shows completions."""
    assert not has_chat_template(tmp_path)
    text = how_to_call("0.0.0.0", 7001, 8001, "gemma-3-270m", chat=False)
    assert "--raw" in text and "/v1/completions " in text and "chat" not in text
    body = re.search(r"grpcurl -plaintext -d '(.+?)' 127\.0\.0\.1:7001 tandem\.v1\.Generation/Generate", text)
    request = json_format.Parse(body.group(1), pb.GenerateRequest())
    assert request.prompt and not request.messages
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    assert has_chat_template(tmp_path)


def test_how_to_call_lines_are_a_tandem_generate_and_a_valid_grpcurl_request():
    text = how_to_call("0.0.0.0", 7001, 8001, "SmolLM2")
    assert "tandem generate --target 127.0.0.1:7001" in text
    body = re.search(r"grpcurl -plaintext -d '(.+?)' 127\.0\.0\.1:7001 tandem\.v1\.Generation/Generate", text)
    assert body is not None
    request = json_format.Parse(body.group(1), pb.GenerateRequest())
    assert request.messages[0].content and request.stopping.max_tokens > 0
    curl = re.search(r"curl http://127\.0\.0\.1:8001/v1/chat/completions .* -d '(.+?)'$", text, re.MULTILINE)
    assert curl is not None
    chat = translate(json.loads(curl.group(1)), Endpoint.CHAT)
    assert chat.generate.messages[0].content and chat.generate.stopping.max_tokens == 64
    sdk = re.search(r"python -c '(.+)'$", text, re.MULTILINE)
    assert sdk is not None and 'base_url="http://127.0.0.1:8001/v1"' in sdk.group(1)
    assert 'model="SmolLM2"' in sdk.group(1)
    compile(sdk.group(1), "sdk-example", "exec")


def test_status_line_reads_requests_kv_usage_and_prefill_queue():
    status = StatusLine(["http://127.0.0.1:1/metrics"], None)
    line = status.render(
        {
            "tandem:num_requests_running": 3,
            "tandem:num_requests_waiting": 1,
            "tandem:kv_cache_usage_perc": 0.25,
            "tandem:generation_tokens_total": 10,
        },
        {"tandem:prefill_queue_depth": 2},
    )
    assert line.startswith("running 3 | waiting 1 | KV 25.0% | ")
    assert line.endswith("tok/s | prefill queue 2")
    assert status.render({}, {}) == "decode metrics unavailable"


# -- the real thing, as a subprocess -------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-up-model")
    save_tiny_model(directory, 9)
    return directory


def tandem_command() -> list[str]:
    return [sys.executable, "-m", "tandem.cli"]


def alive(pid: int) -> bool:
    """Running, not merely unreaped: an orphan's zombie waits for whoever adopted it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class UpProcess:
    """`tandem up --log-format json` on free ports, its stdout and stderr collected line by line."""

    def __init__(self, extra_flags: list[str]) -> None:
        self.port, prefill_port, self.metrics_port, prefill_metrics_port, self.http_port = free_ports(5)
        command = [
            *tandem_command(),
            "up",
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            "--prefill-port",
            str(prefill_port),
            "--metrics-port",
            str(self.metrics_port),
            "--prefill-metrics-port",
            str(prefill_metrics_port),
            "--threads",
            "2",
            "--log-format",
            "json",
            "--startup-timeout",
            str(START_TIMEOUT_S),
            "--stop-timeout",
            "30",
            *extra_flags,
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.ready = threading.Event()
        self.pids: dict[str, int] = {}
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self.stdout.append(line)
            if "tandem is up" in line:
                self.ready.set()

    def _read_stderr(self) -> None:
        for line in self.process.stderr:
            self.stderr.append(line)
            entry = json.loads(line) if line.startswith("{") else {}
            if entry.get("event") == "tier started":
                self.pids[entry["tier"]] = entry["pid"]

    def log(self) -> str:
        return "".join(self.stdout + self.stderr)

    def wait_ready(self, tiers: frozenset[str] = frozenset({"prefill", "decode"})) -> None:
        assert self.ready.wait(START_TIMEOUT_S), "tandem up did not come up:\n" + self.log()
        assert set(self.pids) == tiers

    def generate(self, *flags: str) -> subprocess.CompletedProcess[str]:
        command = [*tandem_command(), "generate", "--target", f"127.0.0.1:{self.port}", *flags]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    def metric(self, name: str, replica: int = 0) -> float:
        url = f"http://127.0.0.1:{self.metrics_port + 10 * replica}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        return samples[name]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)
        for pid in self.pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def up(model_dir) -> Iterator[UpProcess]:
    sizing = ["--block-size", "8", "--kv-cache-memory", "16MiB", "--max-model-len", "512"]
    process = UpProcess(["--model", str(model_dir), *sizing])
    yield process
    process.close()


@pytest.mark.slow
def test_up_serves_streams_and_stops_everything_on_sigint(up):
    up.wait_ready()
    assert all(alive(pid) for pid in up.pids.values())
    result = up.generate("--max-tokens", "8", "--temperature", "0", "hello there")
    assert result.returncode == 0, result.stderr + up.log()
    assert "finish: length" in result.stderr and "+ 8 completion tokens" in result.stderr
    assert up.metric("tandem:generation_tokens_total") == 8
    body = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{up.http_port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.loads(response.read())
    assert (
        answer["usage"]["completion_tokens"] <= 3 and answer["choices"][0]["message"]["role"] == "assistant"
    )
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(90) == EXIT_OK, up.log()
    survivors = [tier for tier, pid in up.pids.items() if alive(pid)]
    assert survivors == [], up.log()


@pytest.mark.slow
def test_a_dead_tier_stops_the_other_and_up_says_which(up):
    up.wait_ready()
    os.kill(up.pids["prefill"], signal.SIGKILL)
    assert up.process.wait(90) == EXIT_PREFILL_EXITED, up.log()
    assert not alive(up.pids["decode"]), up.log()
    events = [json.loads(line) for line in up.stderr if line.startswith("{")]
    assert any(e.get("event") == "tier exited" and e.get("tier") == "prefill" for e in events)


@pytest.mark.slow
def test_killing_up_outright_takes_both_tiers_down(up):
    """The tiers arm their own parent-death signal (no pre-exec hook forking a process with gRPC threads)."""
    up.wait_ready()
    up.process.kill()
    up.process.wait(30)
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in up.pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [tier for tier, pid in up.pids.items() if alive(pid)] == [], up.log()


@pytest.mark.slow
def test_two_decode_replicas_behind_one_prefill_tier_serve_an_affinity_client(model_dir):
    sizing = ["--block-size", "8", "--kv-cache-memory", "16MiB", "--max-model-len", "512"]
    process = UpProcess(["--model", str(model_dir), *sizing, "--decode-replicas", "2"])
    try:
        process.wait_ready(frozenset({"prefill", "decode-0", "decode-1"}))
        target = f"ipv4:127.0.0.1:{process.port},127.0.0.1:{process.port + 10}"
        assert target in process.log()
        with TandemClient(target, affinity=True, timeout=60) as client:
            for index in range(2):  # no shared prefix: each goes to the replica chosen least recently
                completion = client.complete(
                    f"conversation {index} " * 20, max_tokens=4, temperature=0.0, ignore_eos=True
                )
                assert len(completion.token_ids) == 4
        assert [process.metric("tandem:generation_tokens_total", replica) for replica in (0, 1)] == [4, 4]
        os.kill(process.pids["decode-1"], signal.SIGKILL)
        assert process.process.wait(90) == EXIT_DECODE_EXITED, process.log()
        assert not any(alive(pid) for pid in process.pids.values()), process.log()
    finally:
        process.close()


@pytest.mark.slow
@pytest.mark.real_model
def test_up_with_the_default_model_streams_a_real_answer(real_model_dir):
    process = UpProcess(["--kv-cache-memory", "256MiB", "--max-model-len", "1024"])
    try:
        process.wait_ready()
        result = process.generate(
            "--chat", "--max-tokens", "24", "--temperature", "0", "What is the capital of France?"
        )
        assert result.returncode == 0, result.stderr + process.log()
        assert re.search(r"[A-Za-z]{3,}", result.stdout), result.stdout
        process.process.send_signal(signal.SIGTERM)
        assert process.process.wait(90) == EXIT_OK, process.log()
    finally:
        process.close()
