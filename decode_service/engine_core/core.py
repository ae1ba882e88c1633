"""One decode engine core: the scheduler over an engine, its engine loop, remote prefill when the
replica has a prefill tier, and the grammar gate; its boundary with the front door, the same whichever
process the core runs in; and `run_core`, the entry of the core's own process.

The front door speaks `engine_core.messages` to every core: it sends `Submit`, `Abort`, `StopAt` and
`Ping`, and reads one `StepOut` per engine step. `EngineCore.apply` turns those commands into the
engine loop's calls (a `Submit` becomes the core's own `ServedRequest` here, and only here) and each
step's `StreamDelta`s into one `StepOut`, which it hands to `send`: the pipe's writer thread
(`StepWriter`) in a core process of its own, the front door's event loop in this one (`in_process`).

Create it inside a running asyncio loop: remote prefill runs its transfers there.

The core's own process (`run_core`, the entry the front door's `core_client` spawns) loads the model
and runs `EngineCore` with its own GIL; the server process keeps everything else. It reads the server's
`Commands` (submissions, aborts, stop strings, heartbeat pings) and applies them through
`EngineCore.apply`. Only `engine_core.messages` (and `config.CoreSpec`, received once at spawn) are
shared with the server's end (`core_client`).

Lifecycle: the core ignores SIGINT and SIGTERM (the server drains, then sends `Shutdown`), and dies
with the server (parent-death signal, and end of file on its command pipe). A heartbeat ping is
answered from the engine loop, so the answer proves the loop still steps.

Replies are encoded and written on a thread of their own, in order (`StepWriter`): the engine thread
hands each finished message to a bounded queue and goes on stepping, so a front door that stops reading
for a while (its event loop busy, the pipe's 64 KiB full) does not hold the steps of every stream.
Every reply goes through the same queue (`Ready`, `StartFailed`, `Pong`, a failed submission's
`StepOut`), so none overtakes a step.

The bound is a count of messages, `MAX_QUEUED` = 256: a count, not bytes, because a message is only
encoded (and sized) on the writer thread. 256 steps is 2.5 s of 10 ms steps, so a front door that
pauses 2 s costs no step (`bench/slow_front_door.py`); memory stays bounded (a step message carries
one or a few tokens per running stream: about 5 KiB for 64 streams with 5 top logprobs, so 1.3 MiB
queued then). When the queue is full, `put` blocks: backpressure on the engine thread, never a dropped
token.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

from base.errors import ConfigError
from base.heap import freeze_startup_objects
from base.logs import log_event
from decode_service.engine_core.config import CoreConfig, CoreSpec
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
    Ready,
    Shutdown,
    StartFailed,
    StepOut,
    StopAt,
    Submit,
    command_encoder,
    commands_decoder,
)
from decode_service.engine_core.policies import make_policy
from decode_service.engine_core.remote_prefill.stage import RemotePrefill
from decode_service.engine_core.request import ServedRequest, StreamDelta
from decode_service.engine_core.scheduler import ContinuousScheduler, StaticScheduler
from decode_service.engine_core.step_record import StepRecord
from engine.engine import Engine
from engine.sequence import Sequence
from serving import tracing
from serving.event_log import EventLog
from serving.status import status_for

logger = logging.getLogger(__name__)

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
        traceparent=command.traceparent,
    )


def trace_request_end(request: ServedRequest) -> None:
    """The core's spans of a request that just ended, from the times it stamped: its prefill (here or on
    the prefill tier, whose attempts are spans of their own) and its decode; ended now."""
    parent = request.traceparent
    tracing.record_span("prefill", parent, request.admitted_time, request.prefill_done_time)
    attributes = {"gen_ai.usage.output_tokens": request.seq.num_output_tokens}
    tracing.record_span("decode", parent, request.prefill_done_time, None, attributes)


def to_delta(delta: StreamDelta) -> Delta:
    """One choice's step as it crosses the boundary; its state only on the choice's first and last
    deltas, the ones whose readers need it (time to first token, usage, timings, stop)."""
    request = delta.request
    seq = request.seq
    state = None
    if request.traceparent is not None and delta.is_last and request.parent is None:
        trace_request_end(request)
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
        self.loop = EngineLoop(
            engine, self.scheduler, self._step_done, self.events, config.engine_heartbeat_timeout_s
        )
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


PR_SET_PDEATHSIG = 1
MAX_QUEUED = 256

Reply = StepOut | Ready | StartFailed | Pong


def run_core(spec: CoreSpec, warm_up: bool, commands: Connection, replies: Connection) -> None:
    """The core process's entry: serve commands until `Shutdown` or the server's end, then exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    from base.logs import use_log_format

    logging.basicConfig(level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_log_format(spec.log_format)
    if spec.threads is not None:
        import torch

        torch.set_num_threads(spec.threads)
    tracing.configure(spec.otlp_traces_endpoint, "tandem-decode")
    try:
        asyncio.run(_serve_core(spec, warm_up, commands, replies))
    finally:
        tracing.shutdown()


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass  # elsewhere than Linux: the end of file on the command pipe still ends the core


async def _serve_core(spec: CoreSpec, warm_up: bool, commands: Connection, replies: Connection) -> None:
    writer = StepWriter(replies)
    try:
        engine = Engine.from_pretrained(spec.model_dir, spec.engine_config)
        core = EngineCore(engine, spec.config, writer.put, spec.model_fingerprint, record_steps=False)
        await core.start_dependencies()
        core.grammars.start(warm_up=warm_up)
        await asyncio.to_thread(core.grammars.wait_ready)
    except Exception as exc:
        logger.exception("engine core could not start")
        writer.put(StartFailed(f"{type(exc).__name__}: {exc}"))
        await asyncio.to_thread(writer.close)
        return
    freeze_startup_objects()
    writer.put(Ready())
    logger.info("engine core ready (pid %d, %d KV blocks)", os.getpid(), engine.num_blocks)
    await asyncio.to_thread(_apply_commands, commands, core)
    await asyncio.to_thread(core.grammars.stop)
    await core.close_dependencies()
    # After the loop stopped: its last deltas (the aborts of `_on_stop`) are queued, and leave now.
    await asyncio.to_thread(writer.close)


def _apply_commands(commands: Connection, core: EngineCore) -> None:
    """Read command batches and apply them until `Shutdown` or end of file."""
    while True:
        try:
            batch = commands_decoder.decode(commands.recv_bytes())
        except (EOFError, OSError):
            logger.info("the server is gone; stopping the engine core")
            return
        for command in batch.commands:
            if not core.apply(command):
                return


class StepWriter:
    """Encodes and writes `put` messages to `replies` on its own thread; `close` flushes and ends it.

    A broken pipe (the server is gone) is logged once; the messages after it are dropped unwritten, and
    the queue keeps draining so that `put` never waits on a reader that is gone.
    """

    def __init__(
        self,
        replies: Connection,
        max_queued: int = MAX_QUEUED,
        encode: Callable[[Reply], bytes] = command_encoder.encode,
    ) -> None:
        self._replies = replies
        self._encode = encode
        self._max_queued = max_queued
        # None: the end (`close`), put after every message to write. A SimpleQueue's put and get are
        # single C calls, where `queue.Queue`'s take its Python condition on both sides: on the engine
        # thread, once per step.
        self._queue: queue.SimpleQueue[Reply | None] = queue.SimpleQueue()
        # Messages put and taken. `_put` is counted under `_putting` (the engine thread puts steps, the
        # command reader pongs); `_taken` only by the writer thread. `_room` is waited on only by a
        # producer that found the queue full; the writer notifies it as it takes a message.
        self._put = 0
        self._taken = 0
        self._putting = threading.Lock()
        self._room = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="tandem-core-writer", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Messages put and not yet taken by the writer thread."""
        return self._put - self._taken

    def put(self, message: Reply) -> None:
        """Queue `message` after those put before; blocks while the queue is full."""
        with self._putting:
            # Under the lock, so that two producers cannot both take the last free place.
            self._wait_for_room(None)
            self._put += 1
            self._queue.put(message)

    def _wait_for_room(self, timeout: float | None) -> bool:
        """True once fewer than `max_queued` messages wait; False if `timeout` passed first. A stale read
        of `_taken` can only make the queue look fuller, which the locked check below then corrects."""
        if self._put - self._taken < self._max_queued:
            return True
        with self._room:
            return self._room.wait_for(lambda: self._put - self._taken < self._max_queued, timeout)

    def close(self, timeout: float = 10.0) -> bool:
        """Write every message put before, then end the thread; True when it ended within `timeout`.

        A front door that never reads again must not keep the core from exiting: after `timeout` this
        returns anyway (the thread is a daemon)."""
        deadline = time.monotonic() + timeout
        if self._wait_for_room(timeout):
            self._queue.put(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log_event(logger, logging.WARNING, "core replies unflushed", queued=self.queued, waited_s=timeout)
            return False
        return True

    def _take(self) -> Reply | None:
        message = self._queue.get()
        with self._room:
            self._taken += 1
            self._room.notify()
        return message

    def _run(self) -> None:
        broken = False
        while (message := self._take()) is not None:
            if broken:
                continue
            try:
                self._replies.send_bytes(self._encode(message))
            except OSError as exc:
                broken = True
                log_event(logger, logging.INFO, "core replies pipe closed", error=type(exc).__name__)
            except Exception:
                # As the engine loop does with a failed delivery: logged, and the thread lives on (a dead
                # writer would leave the engine thread blocked on a full queue).
                logger.exception("encoding a %s failed", type(message).__name__)
