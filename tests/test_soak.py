"""Soak: good clients and every hostile pattern of issues 13 and 25 at once, against real `tandem serve`
processes.

Both tiers run as subprocesses on a tiny model (decode calls prefill for every prompt). Good clients
send short requests at a light, steady rate the whole time; hostile clients run in 5-second windows,
alternating with quiet ones, so both conditions see the same background load of a shared machine. The
hostile clients run in a process of their own: building and sending their huge requests holds the GIL
for tens of milliseconds at a time, which inside the test process would delay the good clients' own
reading and count against the server.
Over at least 60 s of hostile windows, the good clients' p99 time to first token must stay within 2x of
the quiet windows' (of at least `TTFT_FLOOR_S`), no good request may fail, and at the end no KV block is
held on either tier and both servers still serve.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path

import grpc
import pytest
from conftest import free_ports, save_tiny_model, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from protos.tandem.internal.v1 import prefill_pb2, prefill_pb2_grpc
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc

WINDOW_S = 5.0
# Quiet and hostile windows, finely interleaved so both see the same drift in background load:
# 6 quiet (30 s) and 12 hostile (60 s).
SCHEDULE = (False, True, True) * 6
STALL_TIMEOUT_S = 3.0
# Below this, a p99 on a shared two-core machine is mostly OS scheduling noise (0.26 s measured with one
# core kept busy by another process): the 2x bound applies from here. An unfixed server fails it by
# seconds (huge prompts tokenized inline, slots held by readers that never read).
TTFT_FLOOR_S = 0.25
HTTP_READ_TIMEOUT_S = 2.0
HTTP_MAX_CONNECTIONS = 200
SLOWLORIS_CONNECTIONS = 300
START_TIMEOUT_S = 300.0


class Tier:
    """One `tandem serve` subprocess, its output collected, its /metrics readable."""

    def __init__(self, tier: str, model_dir: Path, port: int, metrics_port: int, flags: list[str]) -> None:
        command = [
            sys.executable,
            "-m",
            "tandem.cli",
            "serve",
            tier,
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--threads",
            "1",
            "--block-size",
            "16",
            "--kv-cache-memory",
            "8MiB",
            "--max-model-len",
            "512",
            "--stream-stall-timeout",
            str(STALL_TIMEOUT_S),
            *flags,
        ]
        self.port, self.metrics_port = port, metrics_port
        self.http_port = int(flags[flags.index("--http-port") + 1]) if "--http-port" in flags else None
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True).start()

    def serving(self) -> bool:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_serving(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.serving():
            assert self.process.poll() is None, "".join(self.log)
            assert time.monotonic() < deadline, "".join(self.log)
            time.sleep(0.5)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}[name]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)


class Hostile:
    """The attacks, each a loop that acts only while `on` is set; its errors go to `errors` as text."""

    def __init__(
        self, decode_port: int, http_port: int, prefill_port: int, on: Event, stop: Event, errors: Queue
    ) -> None:
        self.decode_port, self.http_port, self.prefill_port = decode_port, http_port, prefill_port
        self.on, self.stop, self.errors = on, stop, errors
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{decode_port}", options=[("grpc.max_send_message_length", 8 * 1024 * 1024)]
        )
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.rng = random.Random(13)
        huge_bias = pb.GenerateRequest(prompt="a")
        huge_bias.sampling.logit_bias.update({token_id: 1.0 for token_id in range(380_000)})
        self.huge_bias = huge_bias.SerializeToString()
        self.flood_bodies = [
            json.dumps(body).encode()
            for body in (
                {"messages": [{"role": "user", "content": "hi"}] * 110_000},
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "logit_bias": {str(i): 1 for i in range(380_000)},
                },
            )
        ]

    def loops(self) -> list[Callable[[], None]]:
        return [
            self.stop_strings,
            self.huge_prompts,
            self.big_ids,
            self.malformed,
            self.never_read,
            self.unread_prefill,
            self.rotating_tenants,
            self.min_tokens_and_stop,
            self.slowloris,
            self.refused_flood,
        ]

    def run(self, attack: Callable[[], None]) -> None:
        while not self.stop.is_set():
            if not self.on.wait(0.2):
                continue
            try:
                attack()
            except grpc.RpcError:
                pass  # refusals are the point
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.put(f"{attack.__name__}: {exc!r}")
            time.sleep(0.5)

    def _generate(self, request: pb.GenerateRequest) -> None:
        list(self.stub.Generate(request, timeout=30))

    def stop_strings(self) -> None:
        self._generate(pb.GenerateRequest(prompt="a", stopping=pb.StoppingParams(stop=["ab"] * 20_000)))
        at_limit = [f"{i:03d}" + "q" * 253 for i in range(16)]
        self._generate(
            pb.GenerateRequest(prompt="a", stopping=pb.StoppingParams(max_tokens=4, stop=at_limit))
        )

    def huge_prompts(self) -> None:
        self._generate(pb.GenerateRequest(prompt="x" * (3 * 1024 * 1024)))
        # Under the byte limit, over the context: tokenized on the long-prompt thread, then refused.
        self._generate(pb.GenerateRequest(prompt=" ".join("w" + str(i) for i in range(8000))))

    def big_ids(self) -> None:
        self._generate(pb.GenerateRequest(prompt="a", request_id="r" * 1_300_000))
        self._generate(pb.GenerateRequest(prompt="a", request_id="x\n2026-11-30 ERROR admin login"))
        self.stub.Abort(pb.AbortRequest(request_id=str(self.rng.random())), timeout=10)

    def malformed(self) -> None:
        raw = pb.GenerateRequest(prompt="Hi!").SerializeToString().replace(b"Hi!", b"H\xff!")
        list(self.channel.unary_stream("/tandem.v1.Generation/Generate")(raw, timeout=10))

    def never_read(self) -> None:
        channel = grpc.insecure_channel(
            f"127.0.0.1:{self.decode_port}", options=[("grpc.http2.bdp_probe", 0)]
        )
        request = pb.GenerateRequest(
            request_id=f"{self.rng.random():.12f}".ljust(1024, "n"),
            token_ids=[5, 6, 7],
            stopping=pb.StoppingParams(max_tokens=160, ignore_eos=True),
        )
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
        time.sleep(2 * STALL_TIMEOUT_S)
        call.cancel()
        channel.close()

    def unread_prefill(self) -> None:
        with grpc.insecure_channel(
            f"127.0.0.1:{self.prefill_port}", options=[("grpc.http2.bdp_probe", 0)]
        ) as ch:
            stub = prefill_pb2_grpc.PrefillStub(ch)
            info = stub.GetInfo(prefill_pb2.GetInfoRequest(), timeout=10)
            request = prefill_pb2.PrefillRequest(
                request_id=f"unread-{self.rng.random()}",
                prompt_token_ids=[self.rng.randrange(3, 300) for _ in range(128)],
                sampling=pb.SamplingParams(temperature=0.0),
                compatibility_hash=info.compatibility_hash,
            )
            call = stub.Prefill(request, timeout=60)
            time.sleep(2 * STALL_TIMEOUT_S)
            call.cancel()

    def rotating_tenants(self) -> None:
        for _ in range(5):
            tenant = f"t-{self.rng.randrange(10**9)}"
            self._generate(
                pb.GenerateRequest(prompt="a", tenant=tenant, stopping=pb.StoppingParams(max_tokens=2))
            )

    def min_tokens_and_stop(self) -> None:
        stopping = pb.StoppingParams(max_tokens=12, min_tokens=10, stop=["a", "e"])
        self._generate(pb.GenerateRequest(prompt="the", stopping=stopping, priority=1000))

    def slowloris(self) -> None:
        """More half-sent HTTP requests than the cap allows, held past the read deadline."""
        held = []
        try:
            for _ in range(SLOWLORIS_CONNECTIONS):
                sock = socket.create_connection(("127.0.0.1", self.http_port), timeout=10)
                held.append(sock)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\n")
            time.sleep(2 * HTTP_READ_TIMEOUT_S)
        finally:
            for sock in held:
                sock.close()

    def refused_flood(self) -> None:
        """Requests that are refused, each as large as the doors take, sent back to back."""
        list(self.channel.unary_stream("/tandem.v1.Generation/Generate")(self.huge_bias, timeout=30))
        url = f"http://127.0.0.1:{self.http_port}/v1/chat/completions"
        for body in self.flood_bodies:
            request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
            try:
                urllib.request.urlopen(request, timeout=30).close()
            except urllib.error.HTTPError as refused:
                refused.close()
                assert refused.code == 400, refused.code


def run_hostile(
    decode_port: int, http_port: int, prefill_port: int, on: Event, stop: Event, errors: Queue
) -> None:
    """The attacker process: every attack in a thread of its own until `stop`."""
    hostile = Hostile(decode_port, http_port, prefill_port, on, stop, errors)
    threads = [
        threading.Thread(target=hostile.run, args=(attack,), daemon=True) for attack in hostile.loops()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


def good_client(port: int, stop: Event, on: Event, ttfts: dict[bool, list[float]], errors: list) -> None:
    rng = random.Random(port)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while not stop.is_set():
            request = pb.GenerateRequest(
                prompt=f"Tell me about {rng.randrange(1000)}",
                sampling=pb.SamplingParams(temperature=0.0),
                stopping=pb.StoppingParams(max_tokens=8, ignore_eos=True),
                tenant="good",
            )
            hostile_now = on.is_set()
            started = time.monotonic()
            try:
                stream = stub.Generate(request, timeout=60)
                next(stream)
                ttft = time.monotonic() - started
                list(stream)
            except grpc.RpcError as exc:
                errors.append(exc)
                continue
            # A sample counts for a condition only if the whole request ran in it.
            if on.is_set() == hostile_now:
                ttfts[hostile_now].append(ttft)
            time.sleep(0.25)


def p99(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@pytest.mark.slow
def test_good_clients_keep_their_latency_while_every_attack_runs(tmp_path, record_property):
    model_dir = tmp_path / "model"
    save_tiny_model(model_dir, 21)
    port, metrics_port, prefill_port, prefill_metrics_port, http_port = free_ports(5)
    prefill = Tier(
        "prefill", model_dir, prefill_port, prefill_metrics_port, ["--max-num-batched-tokens", "256"]
    )
    # Decode handshakes with prefill at start-up: start it once prefill serves.
    prefill.wait_serving()
    decode = Tier(
        "decode",
        model_dir,
        port,
        metrics_port,
        [
            "--prefill",
            f"127.0.0.1:{prefill_port}",
            "--policy",
            "wfq",
            "--max-num-seqs",
            "8",
            "--max-queue",
            "16",
            "--max-prompt-bytes",
            "65536",
            "--max-stream-buffer",
            "64",
            "--prefill-timeout",
            "20",
            "--http-port",
            str(http_port),
            "--http-read-timeout",
            str(HTTP_READ_TIMEOUT_S),
            "--http-max-connections",
            str(HTTP_MAX_CONNECTIONS),
        ],
    )
    spawn = multiprocessing.get_context("spawn")
    on, stop, hostile_errors = spawn.Event(), spawn.Event(), spawn.Queue()
    attacker = spawn.Process(
        target=run_hostile, args=(port, http_port, prefill_port, on, stop, hostile_errors), daemon=True
    )
    ttfts: dict[bool, list[float]] = {False: [], True: []}
    good_errors: list[grpc.RpcError] = []
    threads: list[threading.Thread] = []
    try:
        decode.wait_serving()
        attacker.start()
        threads = [
            threading.Thread(target=good_client, args=(port, stop, on, ttfts, good_errors), daemon=True)
            for _ in range(2)
        ]
        for thread in threads:
            thread.start()
        for hostile_window in SCHEDULE:
            (on.set if hostile_window else on.clear)()
            time.sleep(WINDOW_S)
        on.clear()
        stop.set()
        for thread in threads:
            thread.join(60)
        attacker.join(90)

        for tier in (decode, prefill):
            assert tier.process.poll() is None, "".join(tier.log[-40:])
        assert attacker.exitcode == 0, attacker.exitcode
        assert hostile_errors.empty(), hostile_errors.get()
        assert not good_errors, good_errors[:3]
        assert len(ttfts[False]) >= 20 and len(ttfts[True]) >= 40, ttfts
        quiet, attacked = p99(ttfts[False]), p99(ttfts[True])
        record_property("p99_ttft_quiet_s", quiet)
        record_property("p99_ttft_attacked_s", attacked)
        record_property("requests_quiet_attacked", (len(ttfts[False]), len(ttfts[True])))
        assert attacked <= 2 * max(quiet, TTFT_FLOOR_S), (
            f"good clients' p99 TTFT {attacked:.3f} s under attack vs {quiet:.3f} s without"
        )
        for tier in (decode, prefill):
            assert wait_until(lambda tier=tier: tier.metric("tandem:kv_cache_usage_perc") == 0.0, timeout=60)
            assert tier.metric("tandem:num_requests_running") == 0.0
            assert tier.process.poll() is None and tier.serving()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            request = pb.GenerateRequest(prompt="still there?", stopping=pb.StoppingParams(max_tokens=3))
            assert list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60))
    finally:
        stop.set()
        on.clear()
        if attacker.is_alive():
            attacker.kill()
        decode.close()
        prefill.close()
