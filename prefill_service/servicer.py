"""The internal `tandem.internal.v1.Prefill` service: protobuf in, engine-loop calls, KV messages out.

Handlers never run model work: validation is cheap and runs inline, prefill runs on the engine thread,
and KV encoding on the sender's pool. A handler awaits its job's events and turns them into stream
messages. Errors become status codes through `status.status_for`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from base.logs import bind_request_id, log_event, prompt_fields
from engine.engine import Engine
from kv_transfer import KVFrame
from prefill_service.engine_loop import PrefillEngineLoop
from prefill_service.job import KVReady, PrefillFailed, PrefillFinished, PrefillJob
from prefill_service.kv_sender import KVSender
from prefill_service.metrics import PrefillMetrics
from prefill_service.registry import JobRegistry
from prefill_service.validation import build_job
from protos.tandem.internal.v1 import prefill_pb2
from protos.tandem.v1 import generation_pb2
from serving import tracing
from serving.errors import StreamStalledError
from serving.live_calls import StallWatchdog
from serving.status import status_for

logger = logging.getLogger(__name__)


@dataclass
class _StreamStats:
    """What one call has sent so far, for its log lines; `over` once it finished or failed (not cancelled)."""

    kv_messages: int = 0
    kv_bytes: int = 0
    queue_seconds: float = 0.0
    prefill_seconds: float = 0.0
    over: bool = False


def done_message(job: PrefillJob, finished: PrefillFinished) -> prefill_pb2.PrefillResponse:
    """The last message of a successful stream: first token, its logprobs, and where the time went."""
    return prefill_pb2.PrefillResponse(
        done=prefill_pb2.PrefillDone(
            first_token_id=finished.token_id,
            first_token_logprob=finished.logprob,
            top_logprobs=[
                generation_pb2.TopLogprob(token_id=token_id, logprob=logprob)
                for token_id, logprob in finished.top_logprobs
            ],
            num_prompt_tokens=job.num_prompt_tokens,
            num_cached_tokens=job.seq.num_cached_tokens,
            timings=prefill_pb2.PrefillTimings(
                queue_seconds=finished.queue_seconds, prefill_seconds=finished.prefill_seconds
            ),
        )
    )


def _start_span(
    request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext, arrival: float
) -> object:
    """The call's span, a child of the decode tier's prefill attempt when its metadata carries one."""
    traceparent = tracing.traceparent_from(context.invocation_metadata() or ())
    attributes = {
        "tandem.request_id": request.request_id,
        "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
        "tandem.kv.blocks_held": request.num_held_blocks,
    }
    return tracing.start_span("prefill", traceparent, attributes, arrival, kind="SERVER")


def _trace_chunk(span: object, job: PrefillJob, ready: KVReady, chunk_start: float | None) -> float:
    """Spans for the chunk that made `ready`'s blocks (and, before the first, the job's wait in the
    queue); returns when the next chunk's span starts. The engine thread stamped `admitted_time` before
    the step whose blocks these are, so it is set by now."""
    now = time.monotonic()
    if chunk_start is None:
        tracing.record_span("queue", span, job.arrival_time, job.admitted_time)
        chunk_start = job.admitted_time if job.admitted_time is not None else job.arrival_time
    blocks = {"tandem.kv.block_start": ready.block_start, "tandem.kv.num_blocks": ready.num_blocks}
    tracing.record_span("prefill chunk", span, chunk_start, now, blocks)
    return now


class PrefillServicer:
    """GetInfo and Prefill over one engine loop."""

    def __init__(
        self,
        engine: Engine,
        engine_loop: PrefillEngineLoop,
        registry: JobRegistry,
        sender: KVSender,
        info: prefill_pb2.PrefillInfo,
        metrics: PrefillMetrics,
        watchdog: StallWatchdog,
    ) -> None:
        self._engine = engine
        self._engine_loop = engine_loop
        self._registry = registry
        self._sender = sender
        self._info = info
        self._metrics = metrics
        self._watchdog = watchdog

    async def GetInfo(
        self, request: prefill_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillInfo:
        info = prefill_pb2.PrefillInfo()
        info.CopyFrom(self._info)
        return info

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext) -> None:
        # Written through the stall watchdog, not yielded: a caller that stops reading cannot pin blocks.
        # KV frames are already serialized; the method's codec (kv_transfer.grpc_method) passes them on.
        arrival = time.monotonic()
        bind_request_id(request.request_id or "-")
        span = _start_span(request, context, arrival) if tracing.enabled() else None
        try:
            self._registry.check_accepting()
            job = build_job(request, self._engine, self._info.compatibility_hash, arrival)
            self._registry.open(job)
        except Exception as exc:
            self._metrics.call_refused()
            tracing.end_span(span, error=str(exc))
            await self._refuse(context, request, exc)
        log_event(
            logger,
            logging.INFO,
            "prefill accepted",
            request_id=job.request_id,
            prompt_tokens=job.num_prompt_tokens,
            queued=self._registry.num_queued,
            **prompt_fields(prompt_token_ids=list(request.prompt_token_ids)),
        )
        stats = _StreamStats()
        try:
            self._engine_loop.submit(job)
            try:
                with self._watchdog.watch(context) as call:
                    async for response in self._responses(job, stats, span):
                        await call.write(response)
            except StreamStalledError as exc:
                # Counted and logged as cancelled below; the caller sees why if it ever reads again.
                code, message = status_for(exc)
                context.set_code(code)
                context.set_details(message)
                return
            except Exception as exc:
                stats.over = True
                tracing.end_span(span, error=str(exc))
                span = None
                self._fail(context, job, stats, exc)
                return
            stats.over = True
            log_event(
                logger,
                logging.INFO,
                "prefill finished",
                request_id=job.request_id,
                prompt_tokens=job.num_prompt_tokens,
                kv_messages=stats.kv_messages,
                kv_bytes=stats.kv_bytes,
                queue_s=stats.queue_seconds,
                prefill_s=stats.prefill_seconds,
                total_s=time.monotonic() - arrival,
            )
            self._metrics.call_finished(
                job.num_prompt_tokens,
                stats.kv_bytes,
                stats.queue_seconds,
                stats.prefill_seconds,
                time.monotonic() - arrival,
            )
        finally:
            tracing.end_span(span, error=None if stats.over else "cancelled")
            self._registry.close(job)
            # Only now may the blocks go back: the stream has sent them, or never will.
            self._engine_loop.release(job)
            if not stats.over:
                self._metrics.call_cancelled(stats.kv_bytes)
                log_event(
                    logger,
                    logging.INFO,
                    "prefill cancelled",
                    request_id=job.request_id,
                    kv_messages=stats.kv_messages,
                    kv_bytes=stats.kv_bytes,
                    after_s=time.monotonic() - arrival,
                )

    async def _responses(
        self, job: PrefillJob, stats: _StreamStats, span: object = None
    ) -> AsyncIterator[KVFrame | prefill_pb2.PrefillResponse]:
        """KV messages as blocks become ready, then the done message; raises the job's error if it fails.

        With tracing on (`span`), the job's wait in the queue, each chunk that made blocks ready and each
        send of them are spans of the call's."""
        chunk_start: float | None = None
        while True:
            event = await job.events.get()
            if isinstance(event, KVReady):
                if span is not None:
                    chunk_start = _trace_chunk(span, job, event, chunk_start)
                    sent_bytes, send_start = stats.kv_bytes, time.monotonic()
                async for frame in self._sender.frames(event):
                    stats.kv_messages += 1
                    stats.kv_bytes += frame.payload.nbytes
                    yield frame
                if span is not None:
                    sent = {"tandem.kv.bytes": stats.kv_bytes - sent_bytes}
                    tracing.record_span("kv send", span, send_start, None, sent)
            elif isinstance(event, PrefillFinished):
                stats.queue_seconds, stats.prefill_seconds = event.queue_seconds, event.prefill_seconds
                yield done_message(job, event)
                return
            elif isinstance(event, PrefillFailed):
                raise event.error

    def _fail(
        self, context: grpc.aio.ServicerContext, job: PrefillJob, stats: _StreamStats, error: Exception
    ) -> None:
        """End the call with the error's status without waiting: the caller may not be reading."""
        code, message = status_for(error)
        self._metrics.call_failed(stats.kv_bytes)
        log_event(
            logger,
            logging.WARNING,
            "prefill failed",
            request_id=job.request_id,
            code=code.name,
            kv_messages=stats.kv_messages,
            kv_bytes=stats.kv_bytes,
        )
        if code is grpc.StatusCode.INTERNAL:
            logger.error("prefill %s failed: %r", job.request_id, error, exc_info=error)
        context.set_code(code)
        context.set_details(message)

    @staticmethod
    async def _refuse(
        context: grpc.aio.ServicerContext, request: prefill_pb2.PrefillRequest, error: Exception
    ) -> None:
        code, message = status_for(error)
        log_event(
            logger,
            logging.INFO,
            "prefill refused",
            request_id=request.request_id or "-",
            code=code.name,
            prompt_tokens=len(request.prompt_token_ids),
            reason=message,
        )
        if code is grpc.StatusCode.INTERNAL:
            logger.error("prefill request %s refused by a bug: %r", request.request_id, error, exc_info=error)
        await context.abort(code, message)
