"""The decode engine core in a process of its own: the same answers as in process, across the boundary
(aborts, stop strings, choices), and the lifecycle Kubernetes relies on.

The answer tests run a `DecodeServer` given a `CoreSpec` on this test's event-loop thread, so the core
is a real spawned process; the lifecycle tests run `tandem serve decode` as a subprocess, as a pod would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from conftest import free_ports, hf_greedy, random_prompts, save_tiny_model, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny_tokenizer import TINY_VOCAB_SIZE

from decode_service.config import DecodeServiceConfig
from decode_service.engine_core.config import CoreSpec
from decode_service.engine_core.core_client import CoreProcess
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc

MAX_MODEL_LEN = 256


class ProcessServer:
    """A DecodeServer whose engine core is a spawned process, on its own event-loop thread."""

    def __init__(self, model_dir, **config_kwargs) -> None:
        engine_config = EngineConfig(
            cache=CacheConfig(block_size=8, num_blocks=256),
            max_model_len=MAX_MODEL_LEN,
            max_num_seqs=8,
            max_num_batched_tokens=64,
        )
        config = DecodeServiceConfig(host="127.0.0.1", port=0, **config_kwargs)
        self.spec = CoreSpec(model_dir, engine_config, config.core, threads=1)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server: DecodeServer = self.call(self._create(config))
        self.port = self.call(self.server.start(), timeout=120)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def _create(self, config: DecodeServiceConfig) -> DecodeServer:
        return DecodeServer(self.spec, config)

    def call(self, coroutine, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @property
    def core(self) -> CoreProcess:
        assert isinstance(self.server.engine_loop, CoreProcess)
        return self.server.engine_loop

    def idle(self) -> bool:
        stats = self.core.stats
        return stats.num_running == 0 and stats.kv_usage == 0.0 and len(self.server.registry) == 0

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("core_process_model")
    return directory, save_tiny_model(directory, 31)


@pytest.fixture(scope="module")
def server(model):
    running = ProcessServer(model[0])
    yield running
    running.close()


def greedy(token_ids, max_tokens, **kwargs) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=list(token_ids),
        sampling=pb.SamplingParams(temperature=0.0, **kwargs),
        stopping=pb.StoppingParams(ignore_eos=True, max_tokens=max_tokens),
    )


def sample_count(histogram) -> float:
    samples = [s for metric in histogram.collect() for s in metric.samples]
    return next(s.value for s in samples if s.name.endswith("_count"))


def test_the_core_is_another_process(server):
    assert server.core.spec.model_dir == server.spec.model_dir
    assert server.server.scheduler is None and server.server.engine is None
    pid = server.core._process.pid
    assert pid != os.getpid() and os.path.exists(f"/proc/{pid}")


def test_greedy_answers_match_hf_across_the_boundary(server, model):
    hf = model[1]
    queue_times = server.server.metrics.request_queue_time
    queued_before = sample_count(queue_times)
    prompts = random_prompts(8, 5, min_len=1, max_len=40, vocab=TINY_VOCAB_SIZE)
    for index, prompt in enumerate(prompts):
        max_tokens = 1 + (index * 5) % 17
        responses = list(server.stub.Generate(greedy(prompt, max_tokens, logprobs=2), timeout=60))
        tokens = [t for r in responses for t in r.token_ids]
        assert tokens == hf_greedy(hf, prompt, max_tokens), index
        assert all(len(lp.top) == 2 for r in responses for lp in r.logprobs)
        last = responses[-1]
        assert last.finish_reason == pb.LENGTH and last.usage.completion_tokens == max_tokens
        assert last.usage.prompt_tokens == len(prompt) and last.timings.first_token_seconds > 0
    assert wait_until(server.idle)
    # The core's request state reached the front door with each first token (the queue time is observed
    # there only when the admission time is known).
    assert sample_count(queue_times) - queued_before == len(prompts)


def test_choices_and_stop_strings_cross_the_boundary(server, model):
    hf = model[1]
    prompt = random_prompts(1, 9, min_len=12, max_len=12, vocab=TINY_VOCAB_SIZE)[0]
    expected = hf_greedy(hf, prompt, 12)
    request = greedy(prompt, 12)
    request.n = 3
    by_choice: dict[int, list[int]] = {}
    for response in server.stub.Generate(request, timeout=60):
        by_choice.setdefault(response.index, []).extend(response.token_ids)
    assert by_choice == {0: expected, 1: expected, 2: expected}

    text = "".join(r.text for r in server.stub.Generate(greedy(prompt, 12), timeout=60))
    stop = text[len(text) // 2 :][:2]
    assert stop, text
    stopped = greedy(prompt, 12)
    stopped.stopping.stop.append(stop)
    responses = list(server.stub.Generate(stopped, timeout=60))
    assert "".join(r.text for r in responses) == text[: text.index(stop)]
    assert responses[-1].finish_reason == pb.STOP and responses[-1].stop_string == stop
    assert wait_until(server.idle)


def test_constrained_answers_are_enforced_by_the_core(server):
    """The core compiles each constraint from its source, once: a new constraint costs one compile
    (the front door only parses it), a repeated one none (the core's cache)."""
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(server.spec.model_dir)
    metrics = server.server.metrics
    fills = metrics.structured_output_fill_seconds

    def compiles() -> float:
        return sample_count(metrics.structured_output_compile_seconds)

    fills_before, compiles_before = sample_count(fills), compiles()
    constrained_tokens = 0
    for regex in (r"[0-9]{3}-[a-z]{2,4}", r"(yes|no)", r"[0-9]{3}-[a-z]{2,4}"):
        request = pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="Answer.")],
            sampling=pb.SamplingParams(temperature=1.0, seed=3),
            stopping=pb.StoppingParams(max_tokens=40),
            structured_output=pb.StructuredOutput(regex=regex),
        )
        responses = list(server.stub.Generate(request, timeout=120))
        text = tokenizer.decode([t for r in responses for t in r.token_ids])
        assert responses[-1].finish_reason == pb.STOP and re.fullmatch(regex, text), text
        constrained_tokens += sum(len(r.token_ids) for r in responses)
    assert wait_until(server.idle)
    # Every step that masked a token reached the front door's metric, not only the first message's.
    assert sample_count(fills) - fills_before >= constrained_tokens
    # Two distinct constraints in three requests: two compiles, each reported across the pipe.
    assert compiles() - compiles_before == 2


def test_a_cancelled_stream_frees_the_core_blocks(server):
    stream = server.stub.Generate(greedy([5, 6, 7], MAX_MODEL_LEN - 8), timeout=60)
    next(stream)
    assert wait_until(lambda: server.core.stats.kv_usage > 0)
    stream.cancel()
    assert wait_until(server.idle)
    # The server goes on serving, and an abort does not leak into the next request with its id.
    request = greedy([5, 6, 7], 3)
    request.request_id = "reused"
    assert sum(len(r.token_ids) for r in server.stub.Generate(request, timeout=60)) == 3


@pytest.mark.slow
def test_a_plain_request_does_not_wait_for_a_constraint_compiling_in_the_core(server):
    """The core compiles a new constraint on a thread of its own, never on the thread that reads the
    front door's commands: a plain request submitted after a slowly compiling one ends first."""
    # About 40 MiB of grammar, 0.3-3 s to compile (under the default --max-grammar-memory).
    slow_regex = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 450)) + ")"
    core = server.core
    names: dict[int, str] = {}
    ended: list[str] = []
    real_submit, real_on_step = core.submit, core._on_step

    def submit(request) -> None:
        names[request.submission] = request.request_id
        real_submit(request)

    def on_step(step) -> None:
        ended.extend(names[delta.submission] for delta in step.deltas if delta.finish_reason is not None)
        real_on_step(step)

    core.submit, core._on_step = submit, on_step
    try:
        slow = greedy([5, 6, 7], 1)
        slow.request_id = "slow-compile"
        slow.structured_output.regex = slow_regex
        answers: dict[str, list[pb.GenerateResponse]] = {}
        waiting = threading.Thread(
            target=lambda: answers.update(slow=list(server.stub.Generate(slow, timeout=120)))
        )
        waiting.start()
        assert wait_until(lambda: "slow-compile" in names.values(), timeout=120)
        plain = greedy([5, 6, 7], 2)
        plain.request_id = "plain"
        answers["plain"] = list(server.stub.Generate(plain, timeout=60))
        waiting.join(120)
    finally:
        del core.submit
        core._on_step = real_on_step
    assert answers["plain"][-1].finish_reason == pb.LENGTH
    assert answers["slow"][-1].finish_reason in (pb.LENGTH, pb.STOP)
    assert ended.index("plain") < ended.index("slow-compile"), ended
    assert wait_until(server.idle)


# -- lifecycle, on `tandem serve decode` subprocesses ----------------------------------------------


class Serve:
    """`tandem serve decode` on the tiny model, its log collected; `extra` flags override the defaults."""

    def __init__(self, model_dir, *extra: str) -> None:
        self.port, self.metrics_port = free_ports(2)
        command = [
            sys.executable, "-m", "tandem.cli", "serve", "decode", "--model", str(model_dir),
            "--host", "127.0.0.1", "--port", str(self.port), "--threads", "1", "--block-size", "8",
            "--kv-cache-memory", "4MiB", "--max-model-len", str(MAX_MODEL_LEN),
            "--drain-grace-seconds", "30", *extra,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True).start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        if not wait_until(self.serving, timeout=120):
            self.close()  # no server left behind for the tests that follow
            pytest.fail("".join(self.log))

    def serving(self) -> bool:
        assert self.process.poll() is None, "".join(self.log)
        try:
            reply = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def core_pid(self) -> int:
        found = [re.search(r"engine core process started \(pid (\d+)\)", line) for line in self.log]
        pids = [int(match.group(1)) for match in found if match]
        assert len(pids) == 1, "".join(self.log)
        return pids[0]

    def close(self) -> None:
        self.channel.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers until reaped; its state says it is dead.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1].startswith("Z")


@pytest.mark.slow
def test_a_killed_engine_core_ends_every_stream_and_the_server_exits_non_zero(model):
    serve = Serve(model[0])
    try:
        core = serve.core_pid()
        streams = [
            serve.stub.Generate(greedy([3 + i, 4, 5], MAX_MODEL_LEN - 8), timeout=60) for i in range(3)
        ]
        for stream in streams:
            next(stream)
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        for stream in streams:
            with pytest.raises(grpc.RpcError) as ended:
                for _ in stream:
                    pass
            assert ended.value.code() is grpc.StatusCode.UNAVAILABLE, ended.value
            assert "engine core process exited" in ended.value.details()
        # Ended by the pipe's end of file, not by a timeout: well within a second on an idle machine.
        assert time.monotonic() - killed < 5
        assert serve.process.wait(60) == 1, "".join(serve.log)
        assert _gone(core)
        assert any("engine core process exited" in line for line in serve.log)
    finally:
        serve.close()


@pytest.mark.slow
def test_sigterm_drains_through_both_processes(model):
    serve = Serve(model[0])
    try:
        core = serve.core_pid()
        stream = serve.stub.Generate(greedy([7, 8, 9], 40), timeout=60)
        first = next(stream)
        serve.process.send_signal(signal.SIGTERM)
        rest = list(stream)
        tokens = [t for r in [first, *rest] for t in r.token_ids]
        assert len(tokens) == 40 and rest[-1].finish_reason == pb.LENGTH
        assert serve.process.wait(60) == 0, "".join(serve.log)
        assert wait_until(lambda: _gone(core), timeout=30)
    finally:
        serve.close()


# -- a stopped engine core: the heartbeat, and a front door that never waits on the core's pipe --------


def _release(pid: int, parent: int) -> None:
    """Teardown: let a core the test stopped go, by its pid, only while it is still `parent`'s child."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            if int(stat.read().split(") ")[1].split()[1]) != parent:
                return
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError):
        pass


@pytest.mark.slow
def test_a_stopped_engine_core_is_killed_its_streams_end_and_the_server_exits_non_zero(model):
    """SIGSTOP keeps the core's pipes open, so no end of file comes: the unanswered heartbeat must act."""
    serve = Serve(
        model[0], "--engine-heartbeat-timeout", "2", "--max-model-len", "2048", "--kv-cache-memory", "16MiB"
    )
    core = serve.core_pid()
    try:
        health = health_pb2_grpc.HealthStub(serve.channel).Watch(health_pb2.HealthCheckRequest(), timeout=120)
        assert next(health).status == health_pb2.HealthCheckResponse.SERVING
        stream = serve.stub.Generate(greedy([3, 4, 5], 2000), timeout=60)
        next(stream)
        os.kill(core, signal.SIGSTOP)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in stream:
                pass
        assert ended.value.code() is grpc.StatusCode.UNAVAILABLE, ended.value
        assert "did not answer a heartbeat" in ended.value.details()
        statuses = []
        with contextlib.suppress(grpc.RpcError):  # the watch ends with the server
            statuses.extend(reply.status for reply in health)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
        assert serve.process.wait(60) == 1, "".join(serve.log)
        assert wait_until(lambda: _gone(core), timeout=30)
        lost = [line for line in serve.log if "engine core lost" in line]
        assert len(lost) == 1 and "did not answer a heartbeat" in lost[0], "".join(serve.log)
    finally:
        _release(core, serve.process.pid)
        serve.close()


@pytest.mark.slow
def test_the_front_door_answers_while_a_stopped_core_leaves_its_commands_queued(model):
    """Far more than a pipe holds (64 KiB) waits for a stopped core: health still answers, and once the
    core goes on, every request gets its whole answer (the frames survived partial writes)."""
    hf = model[1]
    running = ProcessServer(model[0], engine_heartbeat_timeout_s=600.0)
    core = running.core._process.pid
    prompt = random_prompts(1, 21, min_len=8, max_len=8, vocab=TINY_VOCAB_SIZE)[0]
    streams = []
    try:
        os.kill(core, signal.SIGSTOP)
        for index in range(40):
            request = greedy(prompt, 4)
            # About 5 KB of command each, 200 KB in all: ids and stop strings as long as the limits allow.
            request.request_id = f"{index:04d}" + "r" * 1000
            request.stopping.stop.extend(f"{index:04d}{stop:02d}" + "s" * 240 for stop in range(16))
            streams.append(running.stub.Generate(request, timeout=120))
        submitted = running.server.registry.request_of
        numbers = range(1, len(streams) + 1)
        assert wait_until(lambda: all(submitted(n) is not None for n in numbers), timeout=60)
        reply = health_pb2_grpc.HealthStub(running.channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        os.kill(core, signal.SIGCONT)
        expected = hf_greedy(hf, prompt, 4)
        for stream in streams:
            responses = list(stream)
            assert [t for r in responses for t in r.token_ids] == expected
            assert responses[-1].finish_reason == pb.LENGTH
    finally:
        _release(core, os.getpid())
        running.close()
