"""The public `tandem.v1.Generation` service: protobuf in, engine-loop calls, protobuf out.

Handlers never run model work: validation (which may tokenize) runs on a small executor, generation
runs on the engine thread, and a handler only awaits its stream's queue. Errors become status codes
through `status.status_for`, here and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Executor

import grpc

from decode_service.config import DecodeServiceConfig
from decode_service.engine_loop import EngineLoop
from decode_service.request import ServedRequest, StreamDelta
from decode_service.status import status_for
from decode_service.streams import StreamHub
from decode_service.validation import build_sequence
from engine.config import dtype_name
from engine.engine import Engine
from engine.sequence import FinishReason
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc

logger = logging.getLogger(__name__)

_FINISH_REASONS = {
    FinishReason.STOP: pb.STOP,
    FinishReason.LENGTH: pb.LENGTH,
    FinishReason.ABORT: pb.ABORT,
}


def _since(start: float | None, end: float | None) -> float:
    return end - start if start is not None and end is not None else 0.0


def to_response(delta: StreamDelta) -> pb.GenerateResponse:
    """The stream message for one delta; the last one carries finish reason, stop, usage and timings."""
    request = delta.request
    response = pb.GenerateResponse(request_id=request.request_id, token_ids=delta.token_ids, text=delta.text)
    for logprob in delta.logprobs:
        response.logprobs.append(
            pb.TokenLogprob(
                token_id=logprob.token_id,
                logprob=logprob.logprob,
                top=[pb.TopLogprob(token_id=t, logprob=lp) for t, lp in logprob.top],
            )
        )
    if delta.finish_reason is None:
        return response
    seq = request.seq
    response.finish_reason = _FINISH_REASONS[delta.finish_reason]
    if delta.finish_reason is FinishReason.STOP:
        if isinstance(seq.matched_stop, str):
            response.stop_string = seq.matched_stop
        elif isinstance(seq.matched_stop, int) and seq.matched_stop in seq.stopping.stop_token_ids:
            response.stop_token_id = seq.matched_stop
    response.usage.prompt_tokens = seq.num_prompt_tokens
    response.usage.completion_tokens = seq.num_output_tokens
    response.timings.queue_seconds = _since(request.arrival_time, request.admitted_time)
    response.timings.prefill_seconds = _since(request.admitted_time, request.prefill_done_time)
    response.timings.first_token_seconds = _since(request.arrival_time, request.first_token_time)
    return response


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Generate, Abort and GetModelInfo over one engine loop."""

    def __init__(
        self,
        engine: Engine,
        engine_loop: EngineLoop,
        hub: StreamHub,
        config: DecodeServiceConfig,
        validation_executor: Executor,
        server_version: str,
    ) -> None:
        self._engine = engine
        self._engine_loop = engine_loop
        self._hub = hub
        self._config = config
        self._validation_executor = validation_executor
        self._server_version = server_version

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        arrival = time.monotonic()
        try:
            self._hub.check_accepting()
            request_id = request.request_id or uuid.uuid4().hex
            seq = await asyncio.get_running_loop().run_in_executor(
                self._validation_executor, build_sequence, request, request_id, self._engine,
                self._config.max_tokens_cap,
            )
            served = ServedRequest(
                seq, priority=request.priority, tenant=request.tenant, arrival_time=arrival
            )
            queue = self._hub.open(served)
        except Exception as exc:
            await self._abort_with(context, exc)
        finished = False
        try:
            self._engine_loop.submit(served)
            while not finished:
                delta = await queue.get()
                finished = delta.is_last
                if delta.error is not None:
                    await self._abort_with(context, delta.error)
                yield to_response(delta)
        finally:
            self._hub.close(served)
            if not finished:
                # Client cancelled, deadline passed, or the connection dropped: free the blocks now.
                self._engine_loop.abort(served.request_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if request.request_id not in self._hub:
            return pb.AbortResponse(aborted=False)
        self._engine_loop.abort(request.request_id)
        return pb.AbortResponse(aborted=True)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        engine = self._engine
        return pb.ModelInfo(
            model_name=engine.model_name,
            max_context_length=engine.max_model_len,
            vocab_size=engine.vocab_size,
            eos_token_ids=sorted(engine.eos_token_ids),
            dtype=dtype_name(engine.dtype),
            block_size=engine.block_size,
            mode=pb.SERVING_MODE_AGGREGATED,
            server_version=self._server_version,
        )

    @staticmethod
    async def _abort_with(context: grpc.aio.ServicerContext, error: Exception) -> None:
        code, message = status_for(error)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("request failed: %r", error, exc_info=error)
        await context.abort(code, message)
