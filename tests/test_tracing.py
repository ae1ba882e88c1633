"""OpenTelemetry tracing (`serving.tracing`): off by default and then free, one trace per request across
the decode tier's two processes and the prefill tier when on, and a clear refusal of what cannot work.

The end-to-end test runs both tiers as `tandem serve` processes on the real default model, exporting to
an OTLP receiver in this process (a gRPC server implementing the collector's TraceService), with the
batch processor's delay cut short so spans arrive while the test waits.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import wait_until
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from base.errors import ConfigError
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc
from serving import tracing

ROOT = Path(__file__).resolve().parent.parent
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
JSON_CALLER_TRACE = "5cf92f3577b34da6a3ce929d0e0e4737"
JSON_CALLER_SPAN = "11f067aa0ba902b8"
GRPC_CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
GRPC_CALLER_SPAN = "b7ad6b7169203331"


def traceparent(trace_id: str, span_id: str) -> str:
    return f"00-{trace_id}-{span_id}-01"


class SpanReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP collector's trace endpoint that keeps every span it is sent, with its resource."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[dict] = []

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self._spans.append(
                            {
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_id": span.parent_span_id.hex(),
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                                "service": resource.get("service.name"),
                                "pid": resource.get("process.pid"),
                                "error": span.status.code == span.status.STATUS_CODE_ERROR,
                            }
                        )
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: str | None = None) -> list[dict]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s["trace_id"] == trace_id]


def _value(value) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[tuple[SpanReceiver, str]]:
    spans = SpanReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(spans, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield spans, f"http://127.0.0.1:{port}"
    server.stop(None)


# ---------------------------------------------------------------- the flag and the packages


@pytest.mark.parametrize(
    "value", ["localhost:4317", "grpc://collector:4317", "http://:4317", "http://collector", "http://h:99999"]
)
def test_a_bad_endpoint_is_refused_naming_the_flag(value: str) -> None:
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint must be http://host:port"):
        tracing.resolve_endpoint(value)


def test_the_endpoint_comes_from_the_flag_else_the_sdk_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENDPOINT_VARIABLE, raising=False)
    assert tracing.resolve_endpoint(None) is None
    monkeypatch.setenv(tracing.ENDPOINT_VARIABLE, "https://collector.example:4317")
    assert tracing.resolve_endpoint(None) == "https://collector.example:4317"
    assert tracing.resolve_endpoint("http://127.0.0.1:4317") == "http://127.0.0.1:4317"
    monkeypatch.setenv(tracing.ENDPOINT_VARIABLE, "collector:4317")
    with pytest.raises(ConfigError, match=tracing.ENDPOINT_VARIABLE):
        tracing.resolve_endpoint(None)


def test_tracing_without_the_packages_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(tracing.TracingUnavailableError, match=re.escape("pip install tandem-serve[tracing]")):
        tracing.configure("http://127.0.0.1:4317", "tandem-decode")
    assert not tracing.enabled()


def test_a_tier_with_a_bad_endpoint_exits_at_once_naming_it(tmp_path: Path) -> None:
    """Before the model is looked for: the model directory given does not even exist."""
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "serve", "prefill", "--model", str(tmp_path / "none")]
        + ["--otlp-traces-endpoint", "collector:4317"],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "--otlp-traces-endpoint must be http://host:port" in done.stderr
    assert "collector:4317" in done.stderr


def test_up_passes_the_endpoint_to_both_tiers(tmp_path: Path) -> None:
    from tandem.cli import build_parser
    from tandem.up import tier_specs

    args = build_parser().parse_args(["up", "--otlp-traces-endpoint", "http://collector:4317"])
    specs = tier_specs(args, tmp_path)
    assert {spec.role for spec in specs} == {"prefill", "decode"}
    for spec in specs:
        assert spec.argv[spec.argv.index("--otlp-traces-endpoint") + 1] == "http://collector:4317"
    args = build_parser().parse_args(["up"])
    assert all("--otlp-traces-endpoint" not in spec.argv for spec in tier_specs(args, tmp_path))


# ---------------------------------------------------------------- off: nothing built, nothing imported

OFF_SCRIPT = """
import asyncio, json, sys, tempfile
from pathlib import Path
sys.path.insert(0, "tests")
import grpc, httpx
from conftest import save_tiny_model
from decode_service.config import DecodeServiceConfig
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from protos.tandem.v1 import generation_pb2 as pb, generation_pb2_grpc
from serving import tracing

TRACEPARENT = sys.argv[1]
SDK = ("opentelemetry.sdk", "opentelemetry.exporter")

async def main():
    model_dir = Path(tempfile.mkdtemp())
    save_tiny_model(model_dir, 3)
    config = EngineConfig(cache=CacheConfig(block_size=8, num_blocks=64), max_model_len=128, max_num_seqs=4,
                          max_num_batched_tokens=64)
    server = DecodeServer(Engine.from_pretrained(model_dir, config),
                          DecodeServiceConfig(host="127.0.0.1", port=0, http_port=0))
    port = await server.start()
    submitted = []
    submit = server.engine_loop.submit
    server.engine_loop.submit = lambda request: (submitted.append(request), submit(request))[1]
    stopping = pb.StoppingParams(max_tokens=3, ignore_eos=True)
    request = pb.GenerateRequest(token_ids=[5, 6, 7], stopping=stopping)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        grpc_tokens = [t async for r in stub.Generate(request, metadata=(("traceparent", TRACEPARENT),))
                       for t in r.token_ids]
    async with httpx.AsyncClient() as client:
        answer = await client.post(f"http://127.0.0.1:{server.http_port}/v1/completions",
                                   json={"prompt": [5, 6, 7], "max_tokens": 3},
                                   headers={"traceparent": TRACEPARENT})
    await server.stop()
    print(json.dumps({
        "grpc_tokens": len(grpc_tokens),
        "http_status": answer.status_code,
        "traceparents": [s.traceparent for s in submitted],
        "enabled": tracing.enabled(),
        "sdk": sorted(m for m in sys.modules if m.startswith(SDK)),
    }))

asyncio.run(main())
"""


def test_with_tracing_off_no_span_is_made_and_the_sdk_is_never_imported() -> None:
    """A caller's traceparent on both front doors of a server without tracing: requests are served as
    ever, nothing crosses to the engine core, and neither the SDK nor an exporter is loaded (the API may
    be: FastAPI imports it itself when it is installed)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    # The torch kernels: this test is about the serving path, not the C++ build it would otherwise wait for.
    environment["TANDEM_CPU_EXTENSION"] = "0"
    done = subprocess.run(
        [sys.executable, "-c", OFF_SCRIPT, traceparent(CALLER_TRACE, CALLER_SPAN)],
        cwd=ROOT,
        env=environment | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["grpc_tokens"] == 3 and report["http_status"] == 200
    assert report["traceparents"] == [None, None]
    assert report["enabled"] is False
    assert report["sdk"] == []


def test_helpers_are_no_ops_when_off() -> None:
    assert not tracing.enabled()
    assert tracing.start_span("x", traceparent(CALLER_TRACE, CALLER_SPAN)) is None
    assert tracing.traceparent_from([("traceparent", traceparent(CALLER_TRACE, CALLER_SPAN))]) is None
    assert tracing.grpc_metadata(None) is None
    tracing.record_span("x", None, 0.0, 1.0)
    tracing.end_span(None, {"a": 1}, "failed")


# ---------------------------------------------------------------- on: one trace across both tiers


class TierProcess:
    """`tandem serve <tier>` in a child process; its port is read from its start log line."""

    def __init__(self, tier: str, flags: list[str], environment: dict[str, str]) -> None:
        command = [sys.executable, "-m", "tandem.cli", "serve", tier, *flags]
        self.process = subprocess.Popen(command, cwd=ROOT, env=environment, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        self.port: int | None = None
        self.http_port: int | None = None
        self._serving = threading.Event()
        threading.Thread(target=self._read_log, args=(tier,), daemon=True).start()
        if not self._serving.wait(300):
            self.kill()
            raise RuntimeError(f"{tier} did not start:\n" + "".join(self.log))

    def _read_log(self, tier: str) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            if match := re.search(r"HTTP API on [0-9.]+:([0-9]+)", line):
                self.http_port = int(match.group(1))
            if match := re.search(rf"{tier} server serving .* on [0-9.]+:([0-9]+)", line):
                self.port = int(match.group(1))
                self._serving.set()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(120)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def check_one_tree(spans: list[dict], caller_span: str) -> dict:
    """Every span's parent is in the trace but the root's, which is the caller's span; returns the root."""
    ids = {span["span_id"] for span in spans}
    roots = [span for span in spans if span["parent_id"] not in ids]
    assert len(roots) == 1, [(s["name"], s["parent_id"]) for s in roots]
    assert roots[0]["parent_id"] == caller_span
    return roots[0]


@pytest.mark.slow
@pytest.mark.real_model
def test_one_trace_per_request_across_both_tiers(real_model_dir: Path, receiver) -> None:
    spans, endpoint = receiver
    # Spans leave 100 ms after they end, not 5 s; the torch kernels spare each tier the C++ build.
    environment = os.environ | {
        "PYTHONPATH": str(ROOT),
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "TANDEM_CPU_EXTENSION": "0",
    }
    environment.pop("OTEL_SERVICE_NAME", None)
    common = ["--model", str(real_model_dir), "--host", "127.0.0.1", "--port", "0", "--threads", "1"]
    common += ["--kv-cache-memory", "64MiB", "--max-model-len", "512", "--otlp-traces-endpoint", endpoint]
    prefill = TierProcess("prefill", common, environment)
    decode = None
    try:
        decode = TierProcess(
            "decode", [*common, "--prefill", f"127.0.0.1:{prefill.port}", "--http-port", "0"], environment
        )
        answer = httpx.post(
            f"http://127.0.0.1:{decode.http_port}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Name three colours of the rainbow."}],
                "max_tokens": 4,
                "temperature": 0,
            },
            headers={"traceparent": traceparent(CALLER_TRACE, CALLER_SPAN)},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        constrained = httpx.post(
            f"http://127.0.0.1:{decode.http_port}/v1/completions",
            json={"prompt": "A JSON object:", "max_tokens": 3, "response_format": {"type": "json_object"}},
            headers={"traceparent": traceparent(JSON_CALLER_TRACE, JSON_CALLER_SPAN)},
            timeout=120,
        )
        assert constrained.status_code == 200, constrained.text
        malformed = httpx.post(
            f"http://127.0.0.1:{decode.http_port}/v1/completions",
            json={"prompt": "Hello", "max_tokens": 2},
            headers={"traceparent": "00-not-a-trace-01", "x-request-id": "malformed-parent"},
            timeout=120,
        )
        assert malformed.status_code == 200, malformed.text
        request = pb.GenerateRequest(
            request_id="traced-grpc",
            prompt="The capital of France is",
            stopping=pb.StoppingParams(max_tokens=3, ignore_eos=True),
        )
        with grpc.insecure_channel(f"127.0.0.1:{decode.port}") as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            metadata = (("traceparent", traceparent(GRPC_CALLER_TRACE, GRPC_CALLER_SPAN)),)
            assert sum(len(r.token_ids) for r in stub.Generate(request, metadata=metadata, timeout=120)) == 3
        # Stopping flushes what each process still buffers.
        assert decode.stop() == 0, "".join(decode.log)
        assert prefill.stop() == 0, "".join(prefill.log)
    finally:
        for tier in (decode, prefill):
            if tier is not None:
                tier.kill()

    def names(trace_id: str, service: str) -> set[str]:
        return {span["name"] for span in spans.spans(trace_id) if span["service"] == service}

    decode_names = {"validate", "tokenize", "queue", "prefill", "decode", "remote prefill", "kv receive"}
    prefill_names = {"prefill", "queue", "prefill chunk", "kv send"}
    assert wait_until(lambda: decode_names <= names(CALLER_TRACE, "tandem-decode"))
    assert wait_until(lambda: prefill_names <= names(CALLER_TRACE, "tandem-prefill"))
    chat = spans.spans(CALLER_TRACE)
    root = check_one_tree(chat, CALLER_SPAN)
    usage = body["usage"]
    assert root["name"] == f"chat {body['model']}"
    assert root["service"] == "tandem-decode"
    attributes = root["attributes"]
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "tandem"
    assert attributes["gen_ai.request.model"] == body["model"]
    assert attributes["gen_ai.request.max_tokens"] == 4
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert attributes["gen_ai.response.finish_reasons"] == [body["choices"][0]["finish_reason"]]
    assert body["id"].endswith(attributes["gen_ai.response.id"])
    assert not any(span["error"] for span in chat)

    # The front door and the engine core: one service, two processes; the prefill tier a service of its own.
    on_decode = {span["name"]: span for span in chat if span["service"] == "tandem-decode"}
    front_door = {on_decode[name]["pid"] for name in ("validate", "tokenize", "queue")} | {root["pid"]}
    core = {on_decode[name]["pid"] for name in ("prefill", "decode", "remote prefill", "kv receive")}
    assert len(front_door) == 1 and len(core) == 1 and front_door != core
    on_prefill_tier = [span for span in chat if span["service"] == "tandem-prefill"]
    (server_span,) = [s for s in on_prefill_tier if s["parent_id"] == on_decode["remote prefill"]["span_id"]]
    assert server_span["name"] == "prefill"
    received = on_decode["kv receive"]["attributes"]["tandem.kv.bytes"]
    sent = sum(s["attributes"]["tandem.kv.bytes"] for s in on_prefill_tier if s["name"] == "kv send")
    assert received == sent > 0

    # The gRPC front door takes the caller's context from the call's metadata.
    assert wait_until(lambda: any(s["name"] == "kv send" for s in spans.spans(GRPC_CALLER_TRACE)))
    completion = spans.spans(GRPC_CALLER_TRACE)
    root = check_one_tree(completion, GRPC_CALLER_SPAN)
    assert root["attributes"]["gen_ai.operation.name"] == "text_completion"
    assert root["attributes"]["gen_ai.response.id"] == "traced-grpc"
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 3
    assert root["attributes"]["gen_ai.response.finish_reasons"] == ["length"]

    # A constrained request's grammar is compiled in the engine core, a span of its trace.
    assert wait_until(lambda: any(s["name"] == "kv send" for s in spans.spans(JSON_CALLER_TRACE)))
    constrained_spans = spans.spans(JSON_CALLER_TRACE)
    root = check_one_tree(constrained_spans, JSON_CALLER_SPAN)
    assert root["attributes"]["gen_ai.operation.name"] == "text_completion"
    (compile_span,) = [s for s in constrained_spans if s["name"] == "grammar compile"]
    assert compile_span["parent_id"] == root["span_id"]
    assert compile_span["attributes"]["tandem.grammar.kind"] == "json_object"

    # A malformed traceparent is ignored: the request is served, and its trace starts at the front door.
    def malformed_root() -> list[dict]:
        return [s for s in spans.spans() if s["attributes"].get("gen_ai.response.id") == "malformed-parent"]

    assert wait_until(lambda: len(malformed_root()) == 1)
    assert malformed_root()[0]["parent_id"] == ""
