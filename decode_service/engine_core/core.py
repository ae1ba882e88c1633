"""One decode engine core: the scheduler over an engine, its engine loop, and remote prefill when the
replica has a prefill tier. The same assembly runs on the server's engine thread or in a process of
its own (`engine_core.core_main`).

Create it inside a running asyncio loop: remote prefill runs its transfers there.
"""

from __future__ import annotations

from base.errors import ConfigError
from decode_service.engine_core.config import CoreConfig
from decode_service.engine_core.engine_loop import EngineLoop
from decode_service.engine_core.messages import CoreStats
from decode_service.engine_core.policies import make_policy
from decode_service.engine_core.remote_prefill.stage import RemotePrefill
from decode_service.engine_core.request import StreamDelta
from decode_service.engine_core.scheduler import ContinuousScheduler, StaticScheduler
from decode_service.engine_core.step_record import StepRecord
from engine.engine import Engine
from serving.engine_thread import Deliver
from serving.event_log import EventLog


class EngineCore:
    """Scheduler, engine loop and (disaggregated) remote prefill around one engine.

    `deliver` gets each step's deltas on the engine thread; `events` records each step's batch
    (in-process observers).
    """

    def __init__(
        self,
        engine: Engine,
        config: CoreConfig,
        deliver: Deliver[StreamDelta],
        model_fingerprint: str | None = None,
        record_steps: bool = True,
    ) -> None:
        """`record_steps`: keep the flight recorder of step records (`events`), which tests and the
        occupancy benchmark read in this process; a core in a process of its own has no reader for it."""
        self.engine = engine
        scheduling = config.scheduler
        policy = make_policy(
            scheduling.policy,
            scheduling.tenant_weights,
            scheduling.sjf_aging_tokens_per_second,
            scheduling.max_idle_tenants,
        )
        scheduler_type = StaticScheduler if scheduling.batching == "static" else ContinuousScheduler
        # Disaggregated: the prefill tier's KV must match ours, and the model fingerprint is half of that.
        self.remote_prefill: RemotePrefill | None = None
        if config.remote_prefill.disaggregated:
            if model_fingerprint is None:
                raise ConfigError("disaggregated prefill needs the model fingerprint to check replicas")
            self.remote_prefill = RemotePrefill(engine, config.remote_prefill, model_fingerprint)
        stage = self.remote_prefill.stage if self.remote_prefill is not None else None
        self.scheduler = scheduler_type(engine, policy, scheduling, prefill_stage=stage)
        self.events: EventLog[StepRecord] | None = EventLog(config.event_log_size) if record_steps else None
        self.loop = EngineLoop(engine, self.scheduler, deliver, self.events)
        # Here, in the process that owns the block pool; a taken events port fails the start.
        engine.start_kv_events(config.kv_events)

    async def start_dependencies(self) -> None:
        """Before the engine loop starts: find the prefill replicas the first requests will use."""
        if self.remote_prefill is not None:
            await self.remote_prefill.start()

    async def close_dependencies(self) -> None:
        """After the engine loop stopped, so that no transfer is live and no step publishes events."""
        if self.remote_prefill is not None:
            await self.remote_prefill.close()
        self.engine.stop_kv_events()

    def stats(self) -> CoreStats:
        """The live counters, read without a lock (each is one atomic read under the GIL)."""
        scheduler, engine = self.scheduler, self.engine
        blocks = engine.block_manager
        stats = CoreStats(
            num_running=len(scheduler.running) + len(scheduler.prefill_stage),
            num_waiting=len(scheduler.waiting),
            kv_usage=engine.kv_usage,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=blocks.num_queried_tokens,
            prefix_cache_hits=blocks.num_hit_tokens,
        )
        publisher = engine.kv_events
        if publisher is not None:
            stats.kv_events_published = publisher.num_published
            stats.kv_events_dropped = publisher.num_dropped
        speculation = engine.speculation_stats
        if speculation.num_drafts:
            stats.spec_num_drafts = speculation.num_drafts
            stats.spec_num_draft_tokens = speculation.num_draft_tokens
            stats.spec_num_accepted_tokens = speculation.num_accepted_tokens
            stats.spec_accepted_per_position = list(speculation.accepted_per_position)
        if self.remote_prefill is not None:
            transfer = self.remote_prefill.stats
            stats.kv_transfer_bytes = transfer.kv_bytes_received
            stats.remote_prefills_completed = transfer.remote_prefills_completed
            stats.kv_transfer_seconds = transfer.transfer_seconds
            stats.kv_blocks_skipped = transfer.kv_blocks_skipped
            stats.kv_transfer_failures = transfer.attempt_failures
            stats.local_prefills = transfer.local_prefills
            stats.remote_prefills_failed = transfer.remote_prefills_failed
            stats.prefill_retries = transfer.retries
            stats.prefill_local_fallbacks = transfer.fallbacks_local
        return stats
