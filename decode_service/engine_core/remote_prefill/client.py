"""Running one remote prefill on the event loop: a `Prefill` stream per attempt, retried on another replica.

An attempt picks the least loaded ready replica, streams the prompt's KV into the reserved blocks as it
arrives, and ends with the first token. When a replica fails mid-stream (connection lost, deadline,
corrupt chunk, draining), the partial KV is simply overwritten by the next attempt, which goes to a
replica not tried yet. When none is left, the request falls back to local prefill or fails with
UNAVAILABLE, a message naming each replica tried and what went wrong.

KV writes run on a one-thread executor, so validating (CRC32C) and copying a megabyte-sized chunk
never stalls the event loop that streams every client's tokens; one write is in flight while the next
message arrives (`WritePipeline`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor

import grpc

from base.errors import InvalidRequestError
from decode_service.engine_core.remote_prefill.pool import PrefillPool, PrefillReplica
from decode_service.engine_core.remote_prefill.transfer import (
    KVTransfer,
    PrefillCompleted,
    PrefillGaveUp,
    PrefillOutcome,
    PrefillTransferStats,
    PrefillUnavailableError,
    TransferCancelledError,
)
from decode_service.engine_core.remote_prefill.write_pipeline import WritePipeline
from engine.params import SamplingParams
from kv_transfer import KVFrame, KVFramingError, KVTransferError
from protos.tandem.internal.v1 import prefill_pb2
from protos.tandem.v1 import generation_pb2
from serving import tracing

logger = logging.getLogger(__name__)


class AttemptFailedError(Exception):
    """One Prefill call did not deliver; `request_refused` when the prompt itself was refused."""

    def __init__(self, reason: str, request_refused: bool = False) -> None:
        super().__init__(reason)
        self.request_refused = request_refused


def sampling_proto(params: SamplingParams) -> generation_pb2.SamplingParams:
    """The request's sampling as the internal API carries it (every field set, so no default applies)."""
    proto = generation_pb2.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        logprobs=params.logprobs,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        logit_bias=dict(params.logit_bias),
    )
    if params.seed is not None:
        proto.seed = params.seed
    return proto


class PrefillClient:
    """Runs remote prefills against a pool of replicas (event loop only, except the KV writes)."""

    def __init__(
        self,
        pool: PrefillPool,
        stats: PrefillTransferStats,
        writer: Executor,
        vocab_size: int,
        timeout_s: float,
        max_attempts: int,
    ) -> None:
        self.pool = pool
        self.stats = stats
        self._writer = writer
        self._vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts

    async def run(self, transfer: KVTransfer) -> PrefillOutcome | None:
        """Prefill on up to `max_attempts` distinct replicas; None when the transfer was cancelled."""
        tried: list[PrefillReplica] = []
        reasons: list[str] = []
        refused = False
        while len(tried) < self.max_attempts:
            replica = self.pool.acquire(exclude=tried, affinity=transfer.affinity_key)
            if replica is None:
                break
            if tried:
                self.stats.retries += 1
            tried.append(replica)
            span = None
            if tracing.enabled():
                attributes = {"server.address": replica.address, "tandem.prefill.attempt": len(tried)}
                span = tracing.start_span("remote prefill", transfer.traceparent, attributes, kind="CLIENT")
            try:
                outcome = await self._attempt(replica, transfer, span)
                tracing.end_span(span)
                return outcome
            except TransferCancelledError:
                tracing.end_span(span, error="cancelled")
                return None
            except AttemptFailedError as failure:
                tracing.end_span(span, error=str(failure))
                self.stats.attempt_failures += 1
                reasons.append(f"{replica.address}: {failure}")
                logger.warning(
                    "prefill of %s on %s failed: %s", transfer.request_id, replica.address, failure
                )
                if failure.request_refused:
                    refused = True
                    break
            except BaseException as exc:
                tracing.end_span(span, error=type(exc).__name__)
                raise
            finally:
                self.pool.release(replica)
        return self._give_up(transfer, reasons, refused)

    def _give_up(self, transfer: KVTransfer, reasons: list[str], refused: bool) -> PrefillGaveUp:
        self.stats.remote_prefills_failed += 1
        if refused:
            error: Exception = InvalidRequestError(f"the prefill tier refused the prompt: {reasons[-1]}")
        elif reasons:
            error = PrefillUnavailableError(
                f"prefill failed on every replica tried ({'; '.join(reasons)}); retry later"
            )
        else:
            error = PrefillUnavailableError(f"no prefill replica is available: {self.pool.describe()}")
        return PrefillGaveUp(transfer, error)

    async def _attempt(
        self, replica: PrefillReplica, transfer: KVTransfer, span: object = None
    ) -> PrefillCompleted:
        """One Prefill call; `span` (None when tracing is off) is its parent on the prefill tier, and the
        parent of its KV receive."""
        transfer.restart()
        request = prefill_pb2.PrefillRequest(
            request_id=transfer.request_id,
            prompt_token_ids=transfer.token_ids,
            sampling=sampling_proto(transfer.sampling),
            compatibility_hash=self.pool.compatibility_hash,
            cache_salt=transfer.cache_salt,
            num_held_blocks=transfer.num_held_blocks,
            held_prefix_hash=transfer.held_prefix_hash,
        )
        started = time.monotonic()
        call = replica.stub.Prefill(request, timeout=self.timeout_s, metadata=tracing.grpc_metadata(span))
        writes = WritePipeline(self._writer, transfer.write)
        done: prefill_pb2.PrefillDone | None = None
        first_kv: float | None = None
        received = 0
        done_at = started
        try:
            async for response in call:
                if done is not None:
                    raise AttemptFailedError(self._penalize(replica, "sent a message after PrefillDone"))
                if isinstance(response, KVFramingError):
                    raise response
                if isinstance(response, KVFrame):
                    if first_kv is None:
                        first_kv = time.monotonic()
                    self.stats.kv_messages_received += 1
                    received += self._count_written(replica, await writes.put(response))
                else:
                    received += self._count_written(replica, await writes.flush())
                    done = response.done
                    done_at = time.monotonic()
                    transfer.check_complete(done, self._vocab_size)
        except grpc.aio.AioRpcError as exc:
            if done is None:
                raise self._classify(replica, exc) from exc
            # Every block and the first token arrived, checked; a status lost after that changes nothing.
            logger.debug("prefill %s ended with %s after PrefillDone", transfer.request_id, exc.code().name)
        except KVTransferError as exc:
            reason = f"sent unusable KV ({type(exc).__name__}: {exc})"
            raise AttemptFailedError(self._penalize(replica, reason)) from exc
        finally:
            call.cancel()
            await writes.discard()
        if done is None:
            raise AttemptFailedError(self._penalize(replica, "the stream ended without PrefillDone"))
        self.pool.report_success(replica)
        self.stats.remote_prefills_completed += 1
        self.stats.kv_blocks_skipped += transfer.num_held_blocks
        self.stats.transfer_seconds += done_at - started
        self.stats.kv_stream_seconds += done_at - (first_kv if first_kv is not None else done_at)
        if span is not None:
            attributes = {"tandem.kv.bytes": received, "tandem.kv.blocks_held": transfer.num_held_blocks}
            tracing.record_span("kv receive", span, first_kv, done_at, attributes)
        return PrefillCompleted(
            transfer,
            done.first_token_id,
            done.first_token_logprob,
            tuple((t.token_id, t.logprob) for t in done.top_logprobs),
            done.num_cached_tokens,
        )

    def _count_written(self, replica: PrefillReplica, num_bytes: int) -> int:
        self.stats.kv_bytes_received += num_bytes
        self.pool.report_kv_received(replica, num_bytes)
        return num_bytes

    def _penalize(self, replica: PrefillReplica, reason: str) -> str:
        self.pool.report_failure(replica, reason)
        return reason

    def _classify(self, replica: PrefillReplica, error: grpc.aio.AioRpcError) -> AttemptFailedError:
        """Turn a failed call into the pool's view of the replica and a reason for the logs and the client."""
        code = error.code()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            reason = f"no PrefillDone within the {self.timeout_s:g} s prefill timeout"
        else:
            reason = f"{code.name}: {error.details()}"
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return AttemptFailedError(reason, request_refused=True)
        if code is grpc.StatusCode.FAILED_PRECONDITION:
            self.pool.report_incompatible(replica, error.details() or "compatibility hash refused")
        elif code is grpc.StatusCode.DEADLINE_EXCEEDED:
            self.pool.report_slow(replica, reason)
        elif code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            # A full queue is a busy replica, not a broken one: try another without backing off.
            self._penalize(replica, reason)
        return AttemptFailedError(reason)
