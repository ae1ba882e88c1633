"""The prefill tier without gRPC: chunk packing under a token budget, FIFO admission into the pool,
KV readiness per chunk, blocks held until release, and the edge's validation, status codes and config."""

from __future__ import annotations

import json
import logging
import time

import grpc
import pytest
from conftest import engine_for, tiny_hf_model, wait_until

from base.errors import ConfigError, InvalidRequestError
from base.logs import JsonFormatter, log_event
from decode_service.engine_core.remote_prefill.client import sampling_proto
from engine.config import parse_memory_size
from engine.params import SamplingParams, StoppingParams
from kv_transfer import IncompatibleKVError
from prefill_service.config import PrefillServiceConfig
from prefill_service.engine_loop import PrefillEngineLoop
from prefill_service.job import Admitted, KVReady, PrefillFailed, PrefillFinished, PrefillJob
from prefill_service.scheduler import ChunkedPrefillScheduler
from prefill_service.validation import build_job, sampling_params
from protos.tandem.internal.v1 import prefill_pb2
from protos.tandem.v1 import generation_pb2
from serving.engine_thread import backoff_seconds
from serving.errors import DrainingError, QueueFullError
from serving.event_log import EventLog
from serving.status import status_for

BLOCK_SIZE = 8
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def hf_model():
    return tiny_hf_model(31)


class Harness:
    """A scheduler and engine loop driven step by step in the test's thread, recording every event."""

    def __init__(self, hf_model, num_blocks: int = 64, budget: int = 32, max_num_seqs: int = 8) -> None:
        self.engine = engine_for(hf_model, block_size=BLOCK_SIZE, num_blocks=num_blocks, shuffle_seed=1)
        self.scheduler = ChunkedPrefillScheduler(self.engine, budget, max_num_seqs)
        self.events: list[tuple[PrefillJob, object]] = []
        self.log = EventLog()
        self.loop = PrefillEngineLoop(self.engine, self.scheduler, self.events.extend, self.log)

    def job(self, request_id: str, num_tokens: int) -> PrefillJob:
        prompt = [(7 * i + len(request_id)) % 300 + 3 for i in range(num_tokens)]
        stopping = StoppingParams(max_tokens=1, ignore_eos=True)
        job = PrefillJob(self.engine.make_sequence(prompt, GREEDY, stopping, request_id), arrival_time=0.0)
        self.loop.submit(job)
        return job

    def run(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if not self.loop.step_once():
                return

    def of(self, job: PrefillJob, kind: type) -> list:
        return [event for owner, event in self.events if owner is job and isinstance(event, kind)]

    @property
    def free_blocks(self) -> int:
        return self.engine.block_manager.num_free_blocks


def test_steps_pack_several_prompts_oldest_first_within_the_budget(hf_model):
    harness = Harness(hf_model, budget=32)
    harness.job("a", 10)
    harness.job("b", 40)
    harness.job("c", 20)
    harness.run()
    steps = [step.chunks for step in harness.log.snapshot()]
    # The harness's prompts are prefixes of one another: c, admitted beside b, starts from the two blocks
    # b computed in the first step and prefills only its last 4 tokens.
    assert steps == [
        (("a", 10), ("b", 22)),
        (("b", 18), ("c", 4)),
    ]


def test_kv_is_ready_block_by_block_then_the_first_token(hf_model):
    harness = Harness(hf_model, budget=12)
    # Chunks end at tokens 12, 24, 36, 43: full blocks as they complete, the partial last one at the end.
    job = harness.job("long", 43)
    harness.run()
    ready = harness.of(job, KVReady)
    assert [(r.block_start, r.num_blocks) for r in ready] == [(0, 1), (1, 2), (3, 1), (4, 2)]
    assert all(r.block_tables == (tuple(job.seq.block_table),) and r.ready is None for r in ready)
    kinds = [type(event) for owner, event in harness.events if owner is job]
    assert kinds[0] is Admitted and kinds[-1] is PrefillFinished
    (finished,) = harness.of(job, PrefillFinished)
    assert finished.token_id == job.seq.token_ids[-1]
    assert finished.prefill_seconds >= 0 and finished.queue_seconds >= 0


def test_blocks_are_held_after_prefill_until_release(hf_model):
    harness = Harness(hf_model, num_blocks=16)
    job = harness.job("held", 20)
    harness.run()
    assert harness.of(job, PrefillFinished)
    assert harness.free_blocks == 16 - 3
    harness.loop.release(job)
    harness.loop.step_once()
    assert harness.free_blocks == 16
    assert not harness.scheduler.has_work and not harness.scheduler.held


def test_releasing_a_prompt_mid_prefill_stops_it_and_frees_its_blocks(hf_model):
    harness = Harness(hf_model, num_blocks=16, budget=8)
    job = harness.job("dropped", 100)
    harness.loop.step_once()
    harness.loop.step_once()
    harness.loop.release(job)
    harness.run()
    assert sum(n for step in harness.log.snapshot() for _, n in step.chunks) == 16
    assert not harness.of(job, PrefillFinished)
    assert harness.free_blocks == 16


def test_admission_is_fifo_and_waits_for_blocks_of_the_whole_prompt(hf_model):
    harness = Harness(hf_model, num_blocks=10, budget=64)
    first = harness.job("first", 60)  # 8 blocks
    big = harness.job("big", 30)  # 4 blocks: does not fit next to `first`
    small = harness.job("small", 5)  # would fit, but FIFO keeps it behind `big`
    harness.run()
    assert harness.of(first, PrefillFinished)
    assert not harness.of(big, Admitted) and not harness.of(small, Admitted)
    assert not harness.scheduler.can_step()
    harness.loop.release(first)
    harness.run()
    assert harness.of(big, PrefillFinished) and harness.of(small, PrefillFinished)
    assert [step.request_ids for step in harness.log.snapshot()][-1] == {"big", "small"}


def test_a_finished_prompt_makes_room_under_max_num_seqs_at_once(hf_model):
    harness = Harness(hf_model, max_num_seqs=1)
    first = harness.job("first", 5)
    second = harness.job("second", 5)
    harness.loop.step_once()
    assert harness.of(first, PrefillFinished)
    assert harness.scheduler.can_step(), "the queued prompt must not wait for the first one's stream"
    harness.loop.step_once()
    assert harness.of(second, PrefillFinished)


def test_a_failed_step_fails_its_prompts_and_keeps_their_blocks_until_release(hf_model):
    harness = Harness(hf_model, num_blocks=16)
    job = harness.job("doomed", 20)

    def broken_step(chunks):
        raise RuntimeError("device lost")

    harness.engine.step = broken_step
    harness.loop.step_once()
    (failed,) = harness.of(job, PrefillFailed)
    assert isinstance(failed.error, RuntimeError)
    assert harness.log.snapshot()[-1].failed
    assert harness.free_blocks == 16 - 3 and not harness.scheduler.can_step()
    harness.loop.release(job)
    harness.loop.step_once()
    assert harness.free_blocks == 16


@pytest.mark.parametrize("where", ["admit", "catch_up_prefix"])
def test_a_prompt_whose_scheduling_raises_fails_alone(hf_model, where):
    """A scheduling bug hit by one prompt fails that prompt's call; the prompts beside it and after it
    are prefilled as if it never came, and its blocks come back when its stream is over."""
    harness = Harness(hf_model, num_blocks=32)
    real = getattr(harness.engine, where)

    def broken(seq, *args):
        if seq.request_id == "doomed":
            raise KeyError(-1)
        return real(seq, *args)

    setattr(harness.engine, where, broken)
    before = harness.job("before", 12)
    doomed = harness.job("doomed", 20)
    after = harness.job("after", 9)
    harness.run()
    (failed,) = harness.of(doomed, PrefillFailed)
    assert isinstance(failed.error, KeyError)
    assert harness.of(before, PrefillFinished) and harness.of(after, PrefillFinished)
    assert not harness.of(doomed, PrefillFinished) and not harness.scheduler.can_step()
    for job in (before, doomed, after):
        harness.loop.release(job)
    harness.loop.step_once()
    assert harness.free_blocks == 32


def test_stopping_fails_queued_and_running_prompts_with_draining(hf_model):
    harness = Harness(hf_model, num_blocks=8, budget=8)
    running = harness.job("running", 40)
    queued = harness.job("queued", 40)
    harness.loop.step_once()
    events = harness.scheduler.fail_all(DrainingError("stopping"))
    assert [(job, type(event)) for job, event in events] == [
        (queued, PrefillFailed),
        (running, PrefillFailed),
    ]
    assert not harness.scheduler.has_work
    assert harness.free_blocks == 8 - 5, "the running prompt's blocks stay held until its stream is over"


def test_build_job_checks_compatibility_first_then_the_request(hf_model):
    engine = engine_for(hf_model, block_size=BLOCK_SIZE, num_blocks=4)

    def request(prompt, compat="ours", **sampling) -> prefill_pb2.PrefillRequest:
        return prefill_pb2.PrefillRequest(
            request_id="r",
            prompt_token_ids=prompt,
            sampling=generation_pb2.SamplingParams(**sampling),
            compatibility_hash=compat,
        )

    with pytest.raises(IncompatibleKVError):
        build_job(request([], compat="theirs"), engine, "ours", 0.0)
    for bad in (request([]), request([10**6]), request([1, 2], temperature=-1.0), request([1] * 40)):
        with pytest.raises(InvalidRequestError):
            build_job(bad, engine, "ours", 0.0)
    job = build_job(request([1, 2, 3], seed=7, logprobs=2), engine, "ours", 5.0)
    assert job.num_prompt_tokens == 3 and job.arrival_time == 5.0
    assert job.seq.sampling == SamplingParams(seed=7, logprobs=2)
    unnamed = request([1, 2, 3])
    unnamed.request_id = ""
    assert build_job(unnamed, engine, "ours", 0.0).request_id


def test_sampling_defaults_follow_the_public_api():
    assert sampling_params(generation_pb2.SamplingParams()) == SamplingParams()
    proto = generation_pb2.SamplingParams(
        temperature=0.0, top_p=0.5, top_k=4, min_p=0.1, seed=2**63, logprobs=5
    )
    params = sampling_params(proto)
    assert (params.temperature, params.top_k, params.seed, params.logprobs) == (0.0, 4, 2**63, 5)
    assert params.top_p == pytest.approx(0.5) and params.min_p == pytest.approx(0.1)
    penalized = generation_pb2.SamplingParams(
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25, logit_bias={3: -100.0}
    )
    assert sampling_params(penalized) == SamplingParams(
        presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25, logit_bias={3: -100.0}
    )
    with pytest.raises(InvalidRequestError, match="logit_bias token ids"):
        sampling_params(generation_pb2.SamplingParams(logit_bias={12: 1.0}), vocab_size=12)


def test_decode_sends_every_sampling_field_to_prefill():
    params = SamplingParams(
        temperature=0.5,
        top_k=3,
        seed=9,
        logprobs=2,
        presence_penalty=0.5,
        frequency_penalty=-1.0,
        repetition_penalty=1.25,
        logit_bias={3: -100.0, 1: 2.0},
    )
    assert sampling_params(sampling_proto(params)) == params


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequestError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (IncompatibleKVError("other model"), grpc.StatusCode.FAILED_PRECONDITION),
        (QueueFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (DrainingError("draining"), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("secret internals"), grpc.StatusCode.INTERNAL),
    ],
)
def test_status_codes(error, code):
    mapped, message = status_for(error)
    assert mapped == code
    assert ("secret" not in message) if code == grpc.StatusCode.INTERNAL else message == str(error)


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("2G", 2 * 10**9), ("1.5Gi", 3 * 2**29), ("4096", 4096)],
)
def test_parse_memory_size(text, size):
    assert parse_memory_size(text) == size


@pytest.mark.parametrize("text", ["", "2 parsecs", "-1GiB", "0", "GiB"])
def test_parse_memory_size_rejects_nonsense(text):
    with pytest.raises(ConfigError):
        parse_memory_size(text)


@pytest.mark.parametrize("field", [{"port": 70000}, {"max_queue": 0}, {"drain_grace_seconds": -1}])
def test_config_validation(field):
    with pytest.raises(ConfigError):
        PrefillServiceConfig(**field).validate()


def test_log_events_carry_their_fields_as_text_and_json(caplog):
    logger = logging.getLogger("prefill_service.test")
    with caplog.at_level(logging.INFO, logger="prefill_service.test"):
        log_event(logger, logging.INFO, "prefill finished", request_id="r-1", queue_s=0.25)
    (record,) = caplog.records
    assert record.getMessage() == "prefill finished request_id=r-1 queue_s=0.2500"
    entry = json.loads(JsonFormatter().format(record))
    assert (entry["event"], entry["request_id"], entry["queue_s"]) == ("prefill finished", "r-1", 0.25)


def test_backoff_doubles_per_failure_up_to_a_second():
    assert [backoff_seconds(n) for n in (1, 2, 3)] == [0.01, 0.02, 0.04]
    assert backoff_seconds(7) == 0.64 and backoff_seconds(8) == backoff_seconds(100) == 1.0


def test_a_loop_whose_steps_keep_raising_backs_off_instead_of_spinning(hf_model, caplog):
    """A step that raises on work that stays (a scheduling bug) is retried after a growing wait: a
    thread that spun would make thousands of attempts in the time this one makes a few."""
    harness = Harness(hf_model)
    harness.job("stuck", 12)
    attempts = []

    def broken_schedule():
        attempts.append(None)
        raise KeyError(-1)

    harness.scheduler.schedule = broken_schedule
    harness.loop.start(warm_up=False)
    try:
        assert wait_until(lambda: len(attempts) >= 7)
        time.sleep(1.0)
    finally:
        harness.loop.stop()
    # Seven failures wait 1.27 s in all; the second after them holds one or two more attempts.
    assert len(attempts) <= 12
    assert "step failed (7 in a row)" in caplog.text
