"""The asyncio client: `AsyncTandemClient`, the same API as `TandemClient` with awaitables.

Create it inside the event loop that will use it (grpc.aio channels belong to one loop). Leaving an
`async for` over `generate()` early, or cancelling the task, cancels the call and so the request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
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


class AsyncTandemClient:
    """The asyncio twin of `TandemClient`; see it for the constructor's arguments."""

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
        self._channel = self._settings.aio_channel()
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._picker: ReplicaPicker[generation_pb2_grpc.GenerationStub] | None = (
            ReplicaPicker(target, self._connect) if affinity else None
        )
        self._running: dict[str, Replica[generation_pb2_grpc.GenerationStub]] = {}

    def _connect(self, address: str) -> tuple[generation_pb2_grpc.GenerationStub, Callable[[], object]]:
        channel = self._settings.aio_channel(address)
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
    ) -> AsyncIterator[GenerationDelta]:
        """Stream a completion (`async for`); arguments as in `TandemClient.generate`."""
        return self._stream(build_request(prompt, **options), timeout, metadata)

    async def _stream(
        self, request: pb.GenerateRequest, timeout: float | None, metadata: Metadata | None
    ) -> AsyncIterator[GenerationDelta]:
        if self._picker is not None:
            async for delta in self._affine_stream(self._picker, request, timeout, metadata):
                yield delta
            return
        call = self._stub.Generate(
            request, timeout=self._settings.deadline(timeout), metadata=self._settings.metadata(metadata)
        )
        try:
            async for message in call:
                yield GenerationDelta.from_proto(message)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc
        finally:
            call.cancel()

    async def _affine_stream(
        self,
        picker: ReplicaPicker[generation_pb2_grpc.GenerationStub],
        request: pb.GenerateRequest,
        timeout: float | None,
        metadata: Metadata | None,
    ) -> AsyncIterator[GenerationDelta]:
        """`generate()` on the replica `picker` chooses; see `TandemClient._affine_stream`."""
        attempts = ReplicaAttempts(picker, request, self._running)
        while (replica := attempts.next()) is not None:
            call = replica.stub.Generate(
                request, timeout=self._settings.deadline(timeout), metadata=self._settings.metadata(metadata)
            )
            try:
                async for message in call:
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

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> Completion:
        """Run `generate()` with the same arguments to the end and return the whole completion (n = 1;
        for n > 1, group `generate()`'s deltas by `index`)."""
        builder = CompletionBuilder()
        async for delta in self.generate(prompt, **kwargs):
            builder.add(delta)
        return builder.build()

    async def abort(
        self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> bool:
        """Abort a running or queued request; True if the server found it (its stream ends with ABORT)."""
        request = pb.AbortRequest(request_id=request_id)
        replica = self._running.get(request_id)
        stub = self._stub if replica is None else replica.stub
        response = await self._unary(stub.Abort, request, timeout, metadata)
        return response.aborted

    async def model_info(
        self, *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> ModelInfo:
        response = await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout, metadata)
        return ModelInfo.from_proto(response)

    async def health(
        self, service: str = "", *, timeout: float | None = None, metadata: Metadata | None = None
    ) -> str:
        """The grpc.health.v1 status of `service` ('' is the whole server): 'SERVING', 'NOT_SERVING', ..."""
        request = health_pb2.HealthCheckRequest(service=service)
        response = await self._unary(self._health.Check, request, timeout, metadata)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def _unary(
        self, method: Any, request: Any, timeout: float | None, metadata: Metadata | None
    ) -> Any:
        try:
            return await method(
                request, timeout=self._settings.deadline(timeout), metadata=self._settings.metadata(metadata)
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from exc

    async def close(self) -> None:
        if self._picker is not None:
            for closing in self._picker.close():
                await closing
        await self._channel.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
