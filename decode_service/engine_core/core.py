"""One decode engine core: the scheduler over an engine, its engine loop, remote prefill when the
replica has a prefill tier, and the grammar gate; and its boundary with the front door, the same
whichever process the core runs in.

The front door speaks `engine_core.messages` to every core: it sends `Submit`, `Abort`, `StopAt` and
`Ping`, and reads one `StepOut` per engine step. `EngineCore.apply` turns those commands into the
engine loop's calls (a `Submit` becomes the core's own `ServedRequest` here, and only here) and each
step's `StreamDelta`s into one `StepOut`, which it hands to `send`: the pipe's writer thread in a core
process of its own (`core_main`), the front door's event loop in this one (`in_process`).

Create it inside a running asyncio loop: remote prefill runs its transfers there.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from base.errors import ConfigError
from decode_service.engine_core.config import CoreConfig
from decode_service.engine_core.engine_loop import EngineLoop
from decode_service.engine_core.grammar_gate import GrammarGate
from decode_service.engine_core.messages import (
    Abort,
    ChoiceState,
    Command,
    CoreStats,
    Delta,
    Failure,
    Ping,
    Pong,
    Shutdown,
    StepOut,
    StopAt,
    Submit,
)
from decode_service.engine_core.policies import make_policy
from decode_service.engine_core.remote_prefill.stage import RemotePrefill
from decode_service.engine_core.request import ServedRequest, StreamDelta
from decode_service.engine_core.scheduler import ContinuousScheduler, StaticScheduler
from decode_service.engine_core.step_record import StepRecord
from engine.engine import Engine
from engine.sequence import Sequence
from serving.event_log import EventLog
from serving.status import status_for

Send = Callable[[StepOut | Pong], None]


def failure(error: Exception) -> Failure:
    """`error` as the front door reports it: its gRPC status and message."""
    code, message = status_for(error)
    return Failure(code.name, message, getattr(error, "field", None))


def served_request(command: Submit) -> ServedRequest:
    """The core's live request for a submission the front door validated."""
    seq = Sequence(
        command.request_id,
        command.prompt_token_ids,
        command.sampling,
        command.stopping,
        command.arrival_time,
        command.cache_salt,
    )
    return ServedRequest(
        seq,
        priority=command.priority,
        tenant=command.tenant,
        arrival_time=command.arrival_time,
        n=command.n,
        submission=command.submission,
        grammar=command.grammar,
    )


def to_delta(delta: StreamDelta) -> Delta:
    """One choice's step as it crosses the boundary; its state only on the choice's first and last
    deltas, the ones whose readers need it (time to first token, usage, timings, stop)."""
    request = delta.request
    seq = request.seq
    state = None
    if delta.is_last or seq.num_output_tokens == len(delta.token_ids):
        state = ChoiceState(
            seq.num_cached_tokens,
            seq.matched_stop,
            request.admitted_time,
            request.prefill_done_time,
            request.first_token_time,
            request.num_preemptions,
            request.forked,
        )
    return Delta(
        request.stream_owner.submission,
        request.index,
        delta.token_ids,
        [(lp.token_id, lp.logprob, lp.top) for lp in delta.logprobs] if delta.logprobs else [],
        delta.finish_reason.value if delta.finish_reason is not None else None,
        failure(delta.error) if delta.error is not None else None,
        state,
    )


class EngineCore:
    """Scheduler, engine loop, (disaggregated) remote prefill and grammar gate around one engine, behind
    the front door's messages: `apply` takes a command, `send` gets each step's `StepOut` (from the
    engine thread) and each heartbeat's `Pong` (from the engine loop).

    Requests with a constraint go through the `GrammarGate`, which compiles it on its own thread, never
    on the caller's. `events` records each step's batch (in-process observers).
    """

    def __init__(
        self,
        engine: Engine,
        config: CoreConfig,
        send: Send,
        model_fingerprint: str | None = None,
        record_steps: bool = True,
    ) -> None:
        """`record_steps`: keep the flight recorder of step records (`events`), which tests and the
        occupancy benchmark read in this process; a core in a process of its own has no reader for it."""
        self.engine = engine
        self._send = send
        self._fills: list[float] = []
        # Appended by the grammar gate's compile thread, taken by the engine thread.
        self._compiles: list[float] = []
        self._compiles_lock = threading.Lock()
        engine.grammar_fill_observer = self._observe_fill
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
        self.loop = EngineLoop(engine, self.scheduler, self._step_done, self.events)
        # Here, in the process that owns the block pool; a taken events port fails the start.
        engine.start_kv_events(config.kv_events)
        self.grammars = GrammarGate.for_engine(self.loop, engine, config.grammar, self._observe_compile)

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

    def apply(self, command: Command) -> bool:
        """Hand `command` to the engine loop; False for `Shutdown` (the caller stops the core)."""
        loop = self.loop
        if isinstance(command, Submit):
            try:
                request = served_request(command)
                if request.grammar is None:
                    loop.submit(request)
                else:  # the gate hands it to the loop once its grammar is compiled
                    self.grammars.submit(request)
            except Exception as exc:
                self._refuse(command, exc)
        elif isinstance(command, Abort):
            self.grammars.abort(command.request_id)
        elif isinstance(command, StopAt):
            loop.stop_at_string(command.request_id, command.index, command.stop)
        elif isinstance(command, Ping):
            # Answered from the engine loop, not from here: the answer proves the loop steps.
            loop.answer_heartbeat(functools.partial(self._send, Pong(command.number)))
        elif isinstance(command, Shutdown):
            return False
        return True

    def _observe_fill(self, seconds: float) -> None:
        """The engine's observer of a step's mask fill; the step's `StepOut` carries them."""
        self._fills.append(seconds)

    def _observe_compile(self, seconds: float) -> None:
        """The grammar gate's observer of a compile; the next `StepOut` carries them."""
        with self._compiles_lock:
            self._compiles.append(seconds)

    def _taken_compiles(self) -> list[float]:
        with self._compiles_lock:
            compiles, self._compiles = self._compiles, []
        return compiles

    def _step_done(self, deltas: list[StreamDelta]) -> None:
        """The engine loop's `deliver`: converts on the engine thread, since `to_delta` reads request fields
        the next step changes; whoever `send` is encodes later, elsewhere."""
        fills, self._fills = self._fills, []
        compiles = self._taken_compiles() if self._compiles else []  # no lock on a step without one
        self._send(StepOut([to_delta(d) for d in deltas], self.stats(), fills, compiles))

    def _refuse(self, command: Submit, error: Exception) -> None:
        state = ChoiceState(0, None, None, None, None, 0, False)
        delta = Delta(command.submission, 0, [], [], None, failure(error), state)
        self._send(StepOut([delta], self.stats(), []))
