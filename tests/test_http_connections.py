"""The HTTP port under slow and piled-up clients (issue 25, defects 1 and 7): half-sent requests get 408
and are closed, connections past the cap get 503, a client that stops reading its answer is dropped
after the stall timeout and its request aborted, and the gRPC port serves throughout."""

from __future__ import annotations

import socket
import subprocess
import sys
from contextlib import ExitStack

import pytest
from conftest import save_tiny_model, wait_until
from test_openai_api import Server, grpc_greedy, http_call

from decode_service.front_door.openai_http.connections import GuardedHttpProtocol

HALF_SENT = b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-http-connections-model")
    save_tiny_model(directory, 23)
    return directory


def connect(server: Server, stack: ExitStack, receive_buffer: int | None = None) -> socket.socket:
    sock = stack.enter_context(socket.socket())
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.settimeout(60)
    sock.connect(("127.0.0.1", server.server.http_port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sent before it closed (or reset) the connection."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def test_half_sent_requests_get_408_and_are_closed(model_dir):
    server = Server(model_dir, http_read_timeout_s=0.5)
    try:
        with ExitStack() as stack:
            silent = connect(server, stack)
            headers_only = connect(server, stack)
            headers_only.sendall(HALF_SENT)
            short_body = connect(server, stack)
            short_body.sendall(HALF_SENT + b'Content-Length: 100\r\n\r\n{"prompt":')
            for sock in (silent, headers_only, short_body):
                answer = read_until_closed(sock)
                assert answer.startswith(b"HTTP/1.1 408 "), answer
                assert b"--http-read-timeout" in answer

            # A kept-alive connection gets the deadline again for its next request.
            kept = connect(server, stack)
            body = b'{"prompt": "Hello", "max_tokens": 2}'
            kept.sendall(HALF_SENT + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            first = kept.recv(65536)
            assert first.startswith(b"HTTP/1.1 200 "), first
            kept.sendall(HALF_SENT)
            assert b"HTTP/1.1 408 " in read_until_closed(kept)
        assert wait_until(lambda: server.server.http.open_connections == 0)
        status, _ = http_call(server, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200
    finally:
        server.close()


def test_connections_past_the_cap_get_503_and_grpc_keeps_serving(model_dir):
    server = Server(model_dir, http_max_connections=12, http_read_timeout_s=120)
    try:
        with ExitStack() as stack:
            held = [connect(server, stack) for _ in range(12)]
            for sock in held:
                sock.sendall(HALF_SENT)
            assert wait_until(lambda: server.server.http.open_connections == 12)
            for _ in range(8):
                answer = read_until_closed(connect(server, stack))
                assert answer.startswith(b"HTTP/1.1 503 "), answer
                assert b"--http-max-connections" in answer
            assert server.server.http.open_connections == 12
            assert grpc_greedy(server, 3, prompt="Hello")[-1].usage.completion_tokens == 3
        assert wait_until(lambda: server.server.http.open_connections == 0)
        status, _ = http_call(server, "POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200
    finally:
        server.close()


def _request(body: bytes) -> bytes:
    return HALF_SENT + b"Content-Length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_stops_reading_is_dropped_after_the_stall_timeout(model_dir, stream):
    server = Server(model_dir, max_model_len=1024, stream_stall_timeout_s=1.0)
    try:
        stalled = GuardedHttpProtocol.stalled.count
        ask = b'{"prompt": "Hello", "max_tokens": 900, "logprobs": 20, "ignore_eos": true, "stream": %s}' % (
            b"true" if stream else b"false"
        )
        with ExitStack() as stack:
            reader = connect(server, stack, receive_buffer=4096)
            reader.sendall(_request(ask))
            assert wait_until(lambda: GuardedHttpProtocol.stalled.count > stalled, timeout=120)
            answer = read_until_closed(reader)
        if stream:
            assert b"data: [DONE]" not in answer
        else:
            head, _, body = answer.partition(b"\r\n\r\n")
            length = int(
                next(
                    line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
                ).split(b":")[1]
            )
            assert len(body) < length
        assert wait_until(server.idle)
        assert grpc_greedy(server, 2, prompt="Hello")[-1].usage.completion_tokens == 2
    finally:
        server.close()


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    script = (
        "import resource\n"
        "from serving.open_files import raise_open_file_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))\n"
        "print(raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    returned, soft, hard = (int(value) for value in result.stdout.split())
    assert returned == soft
    assert soft == hard or hard == -1 and soft >= 1 << 20
