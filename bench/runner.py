"""The asyncio load generator: sends a workload to a backend on its arrival schedule, timestamps streams.

One task per request: it sleeps until its send time, waits for a concurrency slot (when capped), then
streams the request and records when each message arrived (`time.perf_counter`). Warm-up requests run
first, all at once, and are not recorded. A request that fails is recorded with its error and does not
stop the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.backends import StreamingBackend
from bench.metrics import RequestRecord
from bench.workload import ArrivalProcess, WorkloadRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """What a run produced: one record per measured request, the run's duration, its request-id tag,
    and the CPU seconds this load generator used meanwhile (on a small shared machine the client takes
    CPU from the server it measures; this says how much)."""

    records: list[RequestRecord]
    duration_s: float
    run_tag: str
    client_cpu_s: float


async def _stream_one(
    backend: StreamingBackend, request: WorkloadRequest, request_id: str, record: RequestRecord
) -> None:
    try:
        async for num_tokens in backend.stream(request, request_id):
            record.add_chunk(time.perf_counter(), num_tokens)
    except Exception as exc:
        # Any failure of one request (status error, broken connection) is data, not a crash of the run.
        record.error = f"{type(exc).__name__}: {exc}"
        logger.debug("request %s failed: %s", request_id, record.error)
    record.end_time = time.perf_counter()


async def warm_up(backend: StreamingBackend, requests: Sequence[WorkloadRequest], run_tag: str) -> None:
    """Send `requests` at once and wait for them; errors are logged, results dropped."""
    records = [RequestRecord(r.index, r.prompt_len, r.output_len, time.perf_counter()) for r in requests]
    await asyncio.gather(
        *(
            _stream_one(backend, request, f"{run_tag}-warmup-{request.index}", record)
            for request, record in zip(requests, records, strict=True)
        )
    )
    failed = [rec.error for rec in records if rec.error]
    if failed:
        logger.warning("%d warm-up requests failed, e.g. %s", len(failed), failed[0])


async def run_load(
    backend: StreamingBackend,
    requests: Sequence[WorkloadRequest],
    arrivals: ArrivalProcess,
    max_concurrency: int | None = None,
    warmup_requests: Sequence[WorkloadRequest] = (),
    show_progress: bool = True,
    description: str = "",
) -> LoadResult:
    """Run `requests` against an opened backend; the clock starts after the warm-up."""
    run_tag = f"bench-{uuid.uuid4().hex[:8]}"
    if warmup_requests:
        await warm_up(backend, warmup_requests, run_tag)
    offsets = arrivals.offsets(len(requests))
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records: list[RequestRecord] = []
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not show_progress,
        transient=True,
    )

    async def one(request: WorkloadRequest, offset: float, task_id) -> None:
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with limiter if limiter is not None else contextlib.nullcontext():
            record = RequestRecord(request.index, request.prompt_len, request.output_len, time.perf_counter())
            records.append(record)
            await _stream_one(backend, request, f"{run_tag}-{request.index}", record)
        progress.advance(task_id)

    with progress:
        task_id = progress.add_task(description or backend.name, total=len(requests))
        start, cpu_start = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(r, o, task_id) for r, o in zip(requests, offsets, strict=True)))
        duration = time.perf_counter() - start
        client_cpu = time.process_time() - cpu_start
    records.sort(key=lambda r: r.index)
    rate = "inf" if math.isinf(arrivals.rate) else f"{arrivals.rate:g}"
    logger.info("%s: %d requests at rate %s in %.1f s", backend.name, len(records), rate, duration)
    return LoadResult(records, duration, run_tag, client_cpu)
