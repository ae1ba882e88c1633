"""The blocking client: `TandemClient`, for scripts and threads.

Every gRPC failure surfaces as a typed `TandemError`. A `generate()` stream that the caller stops
iterating (break, exception, garbage collection) cancels its call, which makes the server abort the
request and free its KV blocks at once instead of generating into the void.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from base.auth import PathLike
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc
from tandem.client.affinity import Replica, ReplicaAttempts, ReplicaPicker
from tandem.client.connection import ConnectionSettings, Metadata
from tandem.client.errors import error_from_rpc
from tandem.client.requests import RequestOptions, build_request
from tandem.client.results import Completion, CompletionBuilder, GenerationDelta, ModelInfo

if TYPE_CHECKING:
    from typing_extensions import Unpack


class TandemClient:
    """A connection to one tandem decode server (or a load balancer in front of several).

    `target` is 'host:port', or `dns:///name:port` (every address the name resolves to, e.g. the pods
    behind the Helm chart's headless decode Service) or `ipv4:a:p,b:q`, which balance calls round-robin
    over the replicas and retry UNAVAILABLE on another one. TLS is on when `tls` is true or any
    certificate path is given: `ca_cert` verifies the server (default: the system's CAs),
    `client_cert`/`client_key` authenticate this client under mTLS. `auth_token` is sent as
    `authorization: Bearer <token>` on every call. `timeout` is the default deadline in seconds of every
    call (a whole `generate()` stream included); None: no deadline. `affinity=True` (with a multi-address
    target) sends each `generate()` to the replica that holds the longest part of its prompt's prefix in
    its cache, within a load bound (see `tandem.client.affinity`), and retries UNAVAILABLE on the next
    best. Use as a context manager, or call `close()`.
    """

    def __init__(
        self,
        target: str,
        *,
        tls: bool = False,
        ca_cert: PathLike | None = None,
        client_cert: PathLike | None = None,
        client_key: PathLike | None = None,
        tls_server_name: str | None = None,
        auth_token: str | None = None,
        timeout: float | None = None,
        options: Iterable[tuple[str, Any]] = (),
        affinity: bool = False,
    ) -> None:
        self._settings = ConnectionSettings.create(
            target,
            tls=tls,
            ca_cert=ca_cert,
            client_cert=client_cert,
            client_key=client_key,
            tls_server_name=tls_server_name,
            auth_token=auth_token,
            timeout=timeout,
            options=options,
        )
        self._channel = self._settings.sync_channel()
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._picker: ReplicaPicker[generation_pb2_grpc.GenerationStub] | None = (
            ReplicaPicker(target, self._connect) if affinity else None
        )
        # Which replica runs each live affinity-routed request, so that `abort` reaches it.
        self._running: dict[str, Replica[generation_pb2_grpc.GenerationStub]] = {}

    def _connect(self, address: str) -> tuple[generation_pb2_grpc.GenerationStub, Callable[[], object]]:
        channel = self._settings.sync_channel(address)
        return generation_pb2_grpc.GenerationStub(channel), channel.close

    @property
    def target(self) -> str:
        return self._settings.target

    def generate(
        self,
        prompt: str | None = None,
        *,
        timeout: float | None = None,
        metadata: Metadata | None = None,
        **options: Unpack[RequestOptions],
    ) -> Iterator[GenerationDelta]:
        """Stream a completion; give exactly one of `prompt`, `token_ids`, `messages`.

        The keyword options are `build_request`'s (`RequestOptions`): each means what the field of the
        same name in generation.proto means, and None leaves it unset so the server's default applies.
        `timeout` and `metadata` are this call's. The call starts on the first `next()`.
        """
        return self._stream(build_request(prompt, **options), timeout, metadata)

    def _stream(
        self, request: pb.GenerateRequest, timeout: float | None, metadata: Metadata | None
    ) -> Iterator[GenerationDelta]:
        if self._picker is not None:
            yield from self._affine_stream(self._picker, request, timeout, metadata)
            return
        call = self._stub.Generate(
            request, timeout=self._settings.deadline(timeout), metadata=self._settings.metadata(metadata)
        )
        try:
            for message in call:
                yield GenerationDelta.from_proto(message)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        finally:
            call.cancel()

    def _affine_stream(
        self,
        picker: ReplicaPicker[generation_pb2_grpc.GenerationStub],
        request: pb.GenerateRequest,
        timeout: float | None,
        metadata: Metadata | None,
    ) -> Iterator[GenerationDelta]:
        """`generate()` on the replica `picker` chooses for the prompt's prefix; a replica that fails with
        UNAVAILABLE before any response is reported and the call goes to the next best."""
        attempts = ReplicaAttempts(picker, request, self._running)
        while (replica := attempts.next()) is not None:
            call = replica.stub.Generate(
                request, timeout=self._settings.deadline(timeout), metadata=self._settings.metadata(metadata)
            )
            try:
                for message in call:
                    attempts.received(message.request_id)
                    yield GenerationDelta.from_proto(message)
                return
            except grpc.RpcError as exc:
                if not attempts.failed(exc):
                    raise error_from_rpc(exc) from exc
            finally:
                call.cancel()
                attempts.done()
        raise attempts.exhausted()

    def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run `generate()` with the same arguments to the end and return the whole completion (n = 1;
        for n > 1, group `generate()`'s deltas by `index`)."""
        builder = CompletionBuilder()
        for delta in self.generate(prompt, **kwargs):
            builder.add(delta)
        return builder.build()

    def abort(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """Abort a running or queued request; True if the server found it (its stream ends with ABORT)."""
        replica = self._running.get(request_id)
        stub = self._stub if replica is None else replica.stub
        response = self._unary(stub.Abort, pb.AbortRequest(request_id=request_id), timeout, metadata)
        return response.aborted

    def model_info(self, *, timeout: float | None = None, metadata: Metadata | None = None) -> ModelInfo:
        response = self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, metadata)
        return ModelInfo.from_proto(response)

    def health(
        self, service: str = "", *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> str:
        """The grpc.health.v1 status of `service` ('' is the whole server): 'SERVING', 'NOT_SERVING', ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        response = self._unary(self._health.Check, request, timeout, metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def _unary(self, method: Any, request: Any, timeout: float | None, metadata: Metadata | None) -> Any:
        try:
            return method(
                request, timeout=self._settings.deadline(timeout), metadata=self._settings.metadata(metadata)
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

    def close(self) -> None:
        if self._picker is not None:
            self._picker.close()
        self._channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
