"""The public `tandem.v1.Generation` service: protobuf in, `Generations` (shared with HTTP), protobuf out.

Handlers never run model work: they await the request's stream and write it through the stall
watchdog. Errors become status codes through `serving.status.status_for`, which the HTTP door's
error mapping also goes through.
"""

from __future__ import annotations

import logging
import time

import grpc

from base.logs import log_event
from decode_service.front_door.admission import tenant_and_priority
from decode_service.front_door.generation import Generations
from engine.config import dtype_name
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc
from serving import tracing
from serving.errors import StreamStalledError
from serving.live_calls import StallWatchdog
from serving.status import status_for

logger = logging.getLogger(__name__)


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Generate, Abort and GetModelInfo over one engine loop."""

    def __init__(
        self, generations: Generations, watchdog: StallWatchdog, server_version: str, disaggregated: bool
    ) -> None:
        self._generations = generations
        self._disaggregated = disaggregated
        self._watchdog = watchdog
        self._server_version = server_version

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # Writes go through the stall watchdog rather than `yield`, so a client that stops reading
        # cannot hold its slot: the write is timed out and the request aborted at once.
        try:
            metadata = tuple(context.invocation_metadata() or ())
            config = self._generations.config
            tenant, priority = tenant_and_priority(
                request, metadata, config.tenant_header, config.priority_header
            )
            generation = await self._generations.start(
                request, time.monotonic(), tenant, priority, tracing.traceparent_from(metadata)
            )
        except Exception as exc:
            await self._refuse(context, exc)
        try:
            with self._watchdog.watch(context) as call:
                while responses := await generation.next_responses():
                    for response in responses:
                        await call.write(response)
        except StreamStalledError as exc:
            log_event(
                logger, logging.WARNING, "request failed", request_id=generation.request_id, code="stalled"
            )
            self._end_with(context, exc)
        except Exception as exc:
            self._end_with(context, exc)
        finally:
            # A cancelled or stalled call stops iterating mid-stream: abort and free the blocks now.
            generation.close()

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        return pb.AbortResponse(aborted=self._generations.abort(request.request_id))

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        model = self._generations.model
        return pb.ModelInfo(
            model_name=model.model_name,
            max_context_length=model.max_model_len,
            vocab_size=model.vocab_size,
            eos_token_ids=sorted(model.eos_token_ids),
            dtype=dtype_name(model.dtype),
            block_size=model.block_size,
            mode=pb.SERVING_MODE_DISAGGREGATED if self._disaggregated else pb.SERVING_MODE_AGGREGATED,
            server_version=self._server_version,
            prefix_caching=model.enable_prefix_caching,
        )

    @staticmethod
    def _end_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
        """End a streaming call with the error's status, without waiting for a client that may not read."""
        code, message = status_for(error)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("request failed: %r", error, exc_info=error)
        context.set_code(code)
        context.set_details(message)

    @staticmethod
    async def _refuse(context: grpc.aio.ServicerContext, error: Exception) -> None:
        """Refuse a call before anything was written to it (the refusal is already logged)."""
        code, message = status_for(error)
        await context.abort(code, message)
