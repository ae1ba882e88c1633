"""Disaggregated prefill as a prefill stage: long prompts on the prefill tier, short ones here.

The scheduler admits a request exactly as in aggregated mode (its prompt blocks reserved) and hands it
to this stage, which routes it:

- locally, with chunked prefill in the decode steps, when fewer than `--local-prefill-threshold`
  tokens are left to compute after this replica's prefix cache hit (moving their KV would cost more
  than computing them), when its first token must suppress EOS or stop tokens (`min_tokens`; the
  internal API cannot ask prefill to), when its grammar would recompute the last prompt position over a
  sliding-window block the handoff leaves out (see below), or when no prefill replica is ready and
  `--fallback-local` is set;
- otherwise remotely: a `KVTransfer` runs on the event loop (`PrefillClient`), writing arriving KV into
  the reserved blocks, and its outcome comes back to the engine thread through `collect`. The
  `Prefill` call says how many leading blocks this replica's prefix cache already holds, with their
  chain hash: the prefill tier checks the hash and sends only the blocks after them.

On the engine thread, a completed transfer becomes exactly what a local prefill produces: the sequence
with every history token computed and the first token appended by
`Engine.append_token_computed_elsewhere`, as `Engine.step` appends what it samples (so stop
rules, detokenization and finishing apply; the first token may end the request). A request with a
grammar drops the prefill tier's token instead and recomputes its last history position here, so its
first token is sampled under the grammar like every other. A transfer whose
request is aborted or preempted is cancelled: the `Prefill` call is cancelled, so the prefill replica
frees its blocks, and no write reaches the reserved blocks once they are given back.

Sliding-window KV groups: the prefill tier sends a sliding group only the blocks a query at the first
position after the history reads (`KVLayout.first_sent_block`), so a remote request gives back at once
the sliding blocks its admission reserved below them (`BlockManager.release_unread`). Should it fall
back to a local prefill, which reads every window on the way, its blocks are reserved again from
scratch, or it fails when they no longer fit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from base.auth import channel_credentials
from decode_service.engine_core.remote_prefill.client import PrefillClient
from decode_service.engine_core.remote_prefill.config import RemotePrefillConfig
from decode_service.engine_core.remote_prefill.pool import PrefillPool
from decode_service.engine_core.remote_prefill.transfer import (
    KVTransfer,
    PrefillCompleted,
    PrefillGaveUp,
    PrefillOutcome,
    PrefillTransferStats,
)
from decode_service.engine_core.request import ServedRequest
from decode_service.engine_core.scheduler import PrefillStage, StageFailure, plan_local_chunks
from engine.engine import Engine, TokenOutput
from engine.model_runner import ScheduledChunk
from kv_transfer import PagedKV
from kv_transfer.heap import keep_message_buffers_in_heap
from serving.kv_layout import engine_fingerprint, engine_kv_layout

logger = logging.getLogger(__name__)

# Prompts whose first blocks (up to this many) are equal go to the same prefill replica: enough to tell
# system prompts apart, few enough that conversations on one system prompt still share a replica.
AFFINITY_BLOCKS = 4


class RemotePrefillStage(PrefillStage):
    """Routes each admitted request to local chunked prefill or to the prefill tier.

    Engine thread: `start`, `remove`, `plan_chunks`, `collect`. Event loop: the transfers' coroutines,
    which hand their outcomes over through a locked queue and `wakeup`.
    """

    def __init__(
        self,
        engine: Engine,
        client: PrefillClient,
        pool: PrefillPool,
        loop: asyncio.AbstractEventLoop,
        stats: PrefillTransferStats,
        local_prefill_threshold: int,
        fallback_local: bool,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.layout = engine_kv_layout(engine)
        # The cache as the KV wire writes it, checked and viewed once for every transfer.
        self._kv = PagedKV.of(engine.kv_cache, self.layout)
        self.local_prefill_threshold = local_prefill_threshold
        self.fallback_local = fallback_local
        self.stats = stats
        self._client = client
        self._pool = pool
        self._loop = loop
        self._remote: dict[ServedRequest, KVTransfer] = {}
        self._outcomes: deque[PrefillOutcome] = deque()
        self._outcomes_lock = threading.Lock()
        self._wakeup: Callable[[], None] = lambda: None

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        self._wakeup = wakeup

    # -- engine thread -------------------------------------------------------------------------------

    def start(self, request: ServedRequest) -> None:
        super().start(request)
        reason = self._local_reason(request)
        if reason is not None:
            self.stats.local_prefills += 1
            logger.debug("prefilling %s locally: %s", request.request_id, reason)
            return
        seq, engine = request.seq, self.engine
        if self.layout.sliding:
            engine.block_manager.release_unread(seq, seq.num_tokens)
        held = seq.num_computed_tokens // engine.block_size
        held_hash = engine.prefix_hash(seq, held) if held else b""
        routed = min(AFFINITY_BLOCKS, (seq.num_tokens - 1) // engine.block_size)
        affinity = engine.prefix_hash(seq, routed) if routed else b""
        transfer = KVTransfer(request, self._kv, held_hash, affinity)
        self._remote[request] = transfer
        self.stats.remote_prefills_started += 1
        try:
            transfer.future = asyncio.run_coroutine_threadsafe(self._run(transfer), self._loop)
        except RuntimeError as exc:  # the event loop is gone: the server is stopping
            self._post(PrefillGaveUp(transfer, exc, can_fall_back=False))

    def _local_reason(self, request: ServedRequest) -> str | None:
        seq = request.seq
        if seq.num_uncomputed_tokens < self.local_prefill_threshold:
            return f"{seq.num_uncomputed_tokens} tokens to compute, under the local prefill threshold"
        if seq.suppressed_token_ids(self.engine.eos_token_ids):
            return "its first token must not be EOS or a stop token (min_tokens)"
        if seq.grammar is not None and self._recompute_reads_unsent_block(seq.num_tokens):
            return "its grammar recomputes the last prompt position, whose window starts a block earlier"
        if self.fallback_local and not self._pool.has_ready:
            return "no prefill replica is ready"
        return None

    def _recompute_reads_unsent_block(self, num_tokens: int) -> bool:
        """Whether a query at the history's last position reads a sliding block the handoff leaves out
        (it is sent from where the next position's window starts): when the window's edge falls on a
        block boundary."""
        layout = self.layout
        return any(
            layout.first_sent_block(group, num_tokens - 1) < layout.first_sent_block(group, num_tokens)
            for group in range(layout.num_groups)
        )

    def remove(self, request: ServedRequest) -> None:
        super().remove(request)
        transfer = self._remote.pop(request, None)
        if transfer is not None:
            transfer.cancel()

    def plan_chunks(self, token_budget: int) -> list[ScheduledChunk]:
        return plan_local_chunks((r for r in self._requests if r not in self._remote), token_budget)

    def collect(self) -> tuple[list[TokenOutput], list[StageFailure]]:
        with self._outcomes_lock:
            outcomes = list(self._outcomes)
            self._outcomes.clear()
        outputs: list[TokenOutput] = []
        failures: list[StageFailure] = []
        for outcome in outcomes:
            transfer = outcome.transfer
            request = transfer.request
            if self._remote.get(request) is not transfer:
                continue  # aborted or preempted since; its blocks are already back
            del self._remote[request]
            if isinstance(outcome, PrefillCompleted):
                request.seq.num_cached_tokens = outcome.num_cached_tokens
                if request.seq.grammar is None:
                    outputs.append(self._first_token(request, outcome))
                else:
                    self._recompute_last_position(request)
                continue
            transfer.cancel()
            if outcome.can_fall_back and self.fallback_local and self._reserve_for_local(request):
                self.stats.fallbacks_local += 1
                logger.warning("prefilling %s locally instead: %s", request.request_id, outcome.error)
            else:
                failures.append((request, outcome.error))
        return outputs, failures

    def _reserve_for_local(self, request: ServedRequest) -> bool:
        """Give a request whose sliding blocks went back at `start` every block a local prefill reads;
        False when they no longer fit (it then fails with the remote error)."""
        if not self.layout.sliding:
            return True
        seq, engine = request.seq, self.engine
        engine.free(seq)
        if not engine.can_allocate(seq, seq.num_tokens):
            return False
        engine.allocate(seq, seq.num_tokens)
        return True

    def _first_token(self, request: ServedRequest, outcome: PrefillCompleted) -> TokenOutput:
        return self.engine.append_token_computed_elsewhere(
            request.seq, outcome.token_id, outcome.logprob, outcome.top_logprobs
        )

    def _recompute_last_position(self, request: ServedRequest) -> None:
        """A constrained request's first token must obey its grammar, which the prefill tier does not
        know: keep the transferred KV but the prefill tier's token, and compute the last history position
        again here, as a one-token local chunk of the next step (which samples it under the grammar)."""
        seq = request.seq
        seq.num_computed_tokens = seq.num_tokens - 1
        self.engine.block_manager.commit(seq)

    # -- event loop ----------------------------------------------------------------------------------

    async def _run(self, transfer: KVTransfer) -> None:
        try:
            outcome = await self._client.run(transfer)
        except Exception as exc:
            logger.exception("remote prefill of %s failed", transfer.request_id)
            outcome = PrefillGaveUp(transfer, exc)
        if outcome is not None:
            self._post(outcome)

    def _post(self, outcome: PrefillOutcome) -> None:
        with self._outcomes_lock:
            self._outcomes.append(outcome)
        self._wakeup()


class RemotePrefill:
    """Disaggregated prefill on one decode replica, built from its config: the replica pool, the client
    that streams KV, the prefill stage the scheduler drives, and the transfer counters.

    Create inside the server's running event loop; `start` before the engine thread runs (so the first
    requests already see which replicas are ready), `close` after it stopped (so no transfer is live).
    """

    def __init__(self, engine: Engine, config: RemotePrefillConfig, model_fingerprint: str) -> None:
        credentials = None
        if config.prefill_tls:
            credentials = channel_credentials(
                config.prefill_tls_ca, config.prefill_tls_cert, config.prefill_tls_key
            )
        keep_message_buffers_in_heap()
        self.stats = PrefillTransferStats()
        self.pool = PrefillPool(
            config.prefill_targets,
            engine_fingerprint(engine, model_fingerprint),
            engine_kv_layout(engine),
            credentials,
            resolve_interval_s=config.prefill_resolve_interval_s,
        )
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-write")
        self.client = PrefillClient(
            self.pool,
            self.stats,
            self._writer,
            engine.vocab_size,
            timeout_s=config.prefill_timeout_s,
            max_attempts=config.prefill_max_attempts,
        )
        self.stage = RemotePrefillStage(
            engine,
            self.client,
            self.pool,
            asyncio.get_running_loop(),
            self.stats,
            local_prefill_threshold=config.local_prefill_threshold,
            fallback_local=config.fallback_local,
        )

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        await self.pool.close()
        self._writer.shutdown(wait=False, cancel_futures=True)
