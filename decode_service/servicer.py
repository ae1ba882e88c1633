"""The public `tandem.v1.Generation` service: protobuf in, engine-loop calls, protobuf out.

Handlers never run model work: cheap limits are checked first, on the loop; validation (which may
tokenize) runs on `ValidationPool`, generation on the engine thread, and a handler only awaits its
stream's queue and writes through the stall watchdog. Errors become status codes
through `status.status_for`, here and nowhere else.
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc

from decode_service.config import DecodeServiceConfig
from decode_service.engine_loop import EngineLoop
from decode_service.request import ServedRequest, StreamDelta
from decode_service.streams import StreamHub
from decode_service.validation import build_sequence, check_limits, num_choices, prompt_bytes
from decode_service.validation_pool import ValidationPool
from engine.config import dtype_name
from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.sequence import FinishReason
from protos.tandem.v1 import generation_pb2 as pb
from protos.tandem.v1 import generation_pb2_grpc
from serving.errors import StreamStalledError
from serving.stalls import StallWatchdog
from serving.status import status_for
from tandem.logs import bind_request_id, log_event, log_prompts_enabled, prompt_fields

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
    response = pb.GenerateResponse(
        request_id=request.request_id, token_ids=delta.token_ids, text=delta.text, index=request.index
    )
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


def check_max_tokens_cap(request: pb.GenerateRequest, max_tokens_cap: int) -> None:
    """Refuse, rather than clip, a max_tokens above the server's cap.

    A silently shortened answer would look like a model that stopped early; an INVALID_ARGUMENT tells
    the client what to change. An unset max_tokens is filled in (up to the cap) by validation.
    """
    if request.stopping.HasField("max_tokens") and request.stopping.max_tokens > max_tokens_cap:
        raise InvalidRequestError(
            f"stopping.max_tokens is {request.stopping.max_tokens}, "
            f"above this server's cap of {max_tokens_cap}"
        )


def _prompt_log_fields(request: pb.GenerateRequest, served: ServedRequest) -> dict[str, object]:
    """The prompt as the client sent it, for `--log-prompts` only (empty otherwise)."""
    return prompt_fields(
        prompt=request.prompt or None,
        messages=[{"role": m.role, "content": m.content} for m in request.messages] or None,
        prompt_token_ids=served.seq.token_ids[: served.seq.num_prompt_tokens],
    )


def _finish_log_fields(request: ServedRequest, now: float) -> dict[str, object]:
    """Counts and timings of a request that just ended, for its `request finished` line."""
    return {
        "prompt_tokens": request.seq.num_prompt_tokens,
        "completion_tokens": request.seq.num_output_tokens,
        "preemptions": request.num_preemptions,
        "queue_s": _since(request.arrival_time, request.admitted_time),
        "ttft_s": _since(request.arrival_time, request.first_token_time),
        "e2e_s": _since(request.arrival_time, now),
    }


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Generate, Abort and GetModelInfo over one engine loop."""

    def __init__(
        self,
        engine: Engine,
        engine_loop: EngineLoop,
        hub: StreamHub,
        config: DecodeServiceConfig,
        validation: ValidationPool,
        watchdog: StallWatchdog,
        server_version: str,
    ) -> None:
        self._engine = engine
        self._engine_loop = engine_loop
        self._hub = hub
        self._config = config
        self._validation = validation
        self._watchdog = watchdog
        self._server_version = server_version

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # Writes go through the stall watchdog rather than `yield`, so a client that stops reading
        # cannot hold its slot: the write is timed out and the cleanup below runs at once.
        arrival = time.monotonic()
        try:
            check_limits(request, self._config.limits, self._engine.max_model_len)
        except InvalidRequestError as exc:
            await self._abort_with(context, exc, "-")
        request_id = request.request_id or uuid.uuid4().hex
        bind_request_id(request_id)
        tenant, priority = self._tenant_and_priority(request, context)
        try:
            self._hub.check_accepting()
            check_max_tokens_cap(request, self._config.max_tokens_cap)
            # A slot before any tokenization: an over-capacity request costs nothing.
            self._hub.reserve(request_id)
        except Exception as exc:
            await self._abort_with(context, exc, request_id)
        try:
            seq = await self._validation.run(
                prompt_bytes(request),
                build_sequence,
                request,
                request_id,
                self._engine,
                self._config.max_tokens_cap,
            )
            served = ServedRequest(
                seq,
                priority=priority,
                tenant=tenant,
                arrival_time=arrival,
                n=num_choices(request, self._engine),
            )
            queue = self._hub.open(served)
        except BaseException as exc:
            # Also when the client leaves while its prompt is tokenized (CancelledError): free the slot.
            self._hub.release(request_id)
            if not isinstance(exc, Exception):
                raise
            await self._abort_with(context, exc, request_id)
        log_event(
            logger,
            logging.INFO,
            "request accepted",
            request_id=request_id,
            prompt_tokens=seq.num_prompt_tokens,
            max_tokens=seq.stopping.max_tokens,
            priority=priority,
            tenant=tenant or "-",
            **_prompt_log_fields(request, served),
        )
        completion: list[str] = []
        finished = False
        choices_left = served.n
        try:
            self._engine_loop.submit(served)
            while not finished:
                delta = await queue.get()
                if delta.is_last:
                    # A request aborted before its prompt was prefilled never forked its other choices.
                    choices_left = choices_left - 1 if served.forked else 0
                finished = choices_left == 0
                if delta.error is not None:
                    self._end_with(context, delta.error, request_id)
                    return
                if log_prompts_enabled():
                    completion.append(delta.text)
                if finished and delta.finish_reason is not None:
                    log_event(
                        logger,
                        logging.INFO,
                        "request finished",
                        request_id=request_id,
                        finish_reason=delta.finish_reason.value,
                        **_finish_log_fields(served, time.monotonic()),
                        **prompt_fields(completion="".join(completion)),
                    )
                await self._watchdog.write(context, to_response(delta))
        except StreamStalledError as exc:
            finished = False
            self._end_with(context, exc, request_id)
        finally:
            self._hub.close(served)
            if not finished:
                # Client cancelled or stopped reading, deadline passed, connection dropped: free the blocks.
                self._engine_loop.abort(served.request_id)
                log_event(
                    logger,
                    logging.INFO,
                    "request cancelled",
                    request_id=request_id,
                    completion_tokens=served.seq.num_output_tokens,
                    after_s=time.monotonic() - arrival,
                )

    def _tenant_and_priority(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> tuple[str, int]:
        """Tenant and priority from the trusted gateway's headers when configured, else from the request."""
        tenant, priority = request.tenant, request.priority
        tenant_header, priority_header = self._config.tenant_header, self._config.priority_header
        if tenant_header or priority_header:
            metadata = dict(context.invocation_metadata() or ())
            if tenant_header:
                tenant = str(metadata.get(tenant_header, ""))
            if priority_header:
                try:
                    priority = int(metadata.get(priority_header, 0))
                except ValueError:
                    priority = 0
        return tenant, priority

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
            mode=pb.SERVING_MODE_DISAGGREGATED if self._config.disaggregated else pb.SERVING_MODE_AGGREGATED,
            server_version=self._server_version,
        )

    @staticmethod
    def _end_with(context: grpc.aio.ServicerContext, error: Exception, request_id: str) -> None:
        """End a streaming call with the error's status, without waiting for a client that may not read."""
        code, message = status_for(error)
        log_event(logger, logging.WARNING, "request failed", request_id=request_id, code=code.name)
        if code is grpc.StatusCode.INTERNAL:
            logger.error("request failed: %r", error, exc_info=error)
        context.set_code(code)
        context.set_details(message)

    @staticmethod
    async def _abort_with(context: grpc.aio.ServicerContext, error: Exception, request_id: str) -> None:
        """Refuse a call before anything was written to it, with the error's status."""
        code, message = status_for(error)
        log_event(
            logger, logging.INFO, "request refused", request_id=request_id, code=code.name, reason=message
        )
        if code is grpc.StatusCode.INTERNAL:
            logger.error("request refused by a bug: %r", error, exc_info=error)
        await context.abort(code, message)
