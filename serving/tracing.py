"""OpenTelemetry traces of requests, one trace per request across both tiers: setup, the W3C trace
context in and out, and the few spans the tiers start.

Off unless `--otlp-traces-endpoint` (or the SDK's own `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) names a
collector. Off, nothing from `opentelemetry` is imported and every helper returns at its first line
without building a span or an attribute; callers that would build attributes ask `enabled()` first.
On, spans leave through the SDK's `BatchSpanProcessor` and OTLP gRPC exporter, which read the other
`OTEL_*` variables themselves (headers, certificates, insecure, timeout, `OTEL_BSP_*` schedule);
`OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` name the service, else the tier does.

The context crosses processes as a W3C `traceparent` string: in HTTP headers and gRPC metadata from the
caller, in gRPC metadata to the prefill tier, and in the `Submit` message to the decode engine core.
Times are monotonic seconds, as the tiers stamp them (both decode processes read the same clock); they
become wall-clock nanoseconds only here, so a span can also be recorded after the fact from timestamps
the request already carries.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from base.errors import ConfigError
from base.settings import OTLP_TRACES_ENDPOINT_ENV, get_settings

TRACEPARENT = "traceparent"
ENDPOINT_VARIABLE = OTLP_TRACES_ENDPOINT_ENV
INSTALL_HINT = "pip install tandem-serve[tracing]"

Attributes = Mapping[str, Any]
# A span's parent: a span, a `traceparent` string, or None for a new trace.
Parent = Any

# Set by `configure`, only when tracing is on; None means every helper is a no-op.
_tracer: Any = None
_provider: Any = None
_propagator: Any = None
_endpoint: str | None = None


class TracingUnavailableError(ConfigError):
    """Tracing was asked for, but the OpenTelemetry SDK or its OTLP exporter is not installed."""


def check_endpoint(value: str, source: str) -> str:
    """`value` if it is an OTLP gRPC endpoint, `http://host:port` (plaintext) or `https://host:port`
    (TLS); else ConfigError naming `source` (the flag or variable it came from)."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(
            f"{source} must be http://host:port or https://host:port, got {value!r} ({exc})"
        ) from exc
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ConfigError(
            f"{source} must be http://host:port (plaintext) or https://host:port (TLS), got {value!r}"
        )
    return value


def resolve_endpoint(flag_value: str | None) -> str | None:
    """The collector to export to: the flag, else the SDK's variable, else None (tracing off)."""
    if flag_value is not None:
        return check_endpoint(flag_value, "--otlp-traces-endpoint")
    from_environment = get_settings().otlp_traces_endpoint
    if from_environment:
        return check_endpoint(from_environment, ENDPOINT_VARIABLE)
    return None


def configure(endpoint: str | None, service_name: str) -> None:
    """Turn tracing on, exporting to `endpoint` as `service_name` (unless the OTEL_* variables name the
    service); None leaves it off. Raises TracingUnavailableError when the packages are missing."""
    global _tracer, _provider, _propagator, _endpoint
    if endpoint is None:
        return
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as exc:
        raise TracingUnavailableError(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP gRPC exporter ("
            f"{exc.name or exc} is missing): {INSTALL_HINT}"
        ) from exc
    # The process too: the decode tier's front door and engine core are one service, two processes.
    resource = Resource.create({"process.pid": os.getpid()})
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _provider, _endpoint = provider, endpoint
    _tracer = provider.get_tracer("tandem")
    _propagator = TraceContextTextMapPropagator()


def enabled() -> bool:
    return _tracer is not None


def exporting_to() -> str | None:
    """The collector spans go to, for a child process to export to as well; None when off."""
    return _endpoint


def shutdown() -> None:
    """Send every span still buffered, then stop exporting (on server stop; a no-op when off)."""
    global _tracer, _provider, _endpoint
    provider = _provider
    if provider is None:
        return
    _tracer = _provider = _endpoint = None
    provider.force_flush()
    provider.shutdown()


def traceparent_from(headers: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The caller's `traceparent` among HTTP headers or gRPC metadata (keys lower-case); None when off."""
    if _tracer is None:
        return None
    for key, value in headers:
        if key == TRACEPARENT:
            return value.decode("latin-1") if isinstance(value, bytes) else value
    return None


def _wall_ns(monotonic_s: float | None) -> int | None:
    if monotonic_s is None:
        return None
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _context(parent: Parent) -> Any:
    from opentelemetry import trace

    if parent is None:
        return None
    if isinstance(parent, str):
        return _propagator.extract({TRACEPARENT: parent})
    return trace.set_span_in_context(parent)


def start_span(
    name: str,
    parent: Parent = None,
    attributes: Attributes | None = None,
    start: float | None = None,
    kind: str = "INTERNAL",
) -> Any:
    """A started span (None when off), child of `parent`; `start` in monotonic seconds (default now),
    `kind` a `SpanKind` name (SERVER where a call comes in, CLIENT where one goes out)."""
    if _tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    return _tracer.start_span(name, _context(parent), SpanKind[kind], attributes, start_time=_wall_ns(start))


def end_span(
    span: Any, attributes: Attributes | None = None, error: str | None = None, end: float | None = None
) -> None:
    """End `span` (nothing when None), adding `attributes`; `error` marks it failed, saying why."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=_wall_ns(end))


def record_span(
    name: str, parent: Parent, start: float | None, end: float | None, attributes: Attributes | None = None
) -> None:
    """A span that already happened, from its monotonic start and end (nothing when off, or when the
    start is unknown: the step never took place)."""
    if _tracer is None or start is None:
        return
    end_span(start_span(name, parent, attributes, start), end=end if end is not None else time.monotonic())


def traceparent_of(span: Any) -> str | None:
    """`span`'s context as a W3C `traceparent`, to hand to another process; None for no span."""
    if span is None:
        return None
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, _context(span))
    return carrier.get(TRACEPARENT)


def grpc_metadata(span: Any) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying `span` as the parent of what the called server does; None for no span."""
    traceparent = traceparent_of(span)
    return None if traceparent is None else ((TRACEPARENT, traceparent),)
