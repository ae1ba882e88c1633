"""What a long prompt does to everyone else's inter-token latency, with and without chunked prefill.

A few streams decode steadily; once each has some tokens, one 4k-token prompt arrives. With chunked
prefill (a per-step token budget, the server default 512) the prompt is prefilled a slice per step next
to the running decodes, so their ITL rises moderately for several steps. Without it (a budget large
enough to take the whole prompt in one step) every running stream stalls for the whole prefill. Both
settings run as real `tandem serve decode` processes; ITLs are measured by the client. Writes
`chunked_prefill.json` and `chunked_prefill_itl.png`.

    tandem bench chunked-prefill [--long-prompt-len 4096 --num-streams 8 --threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path

from bench.metrics import RequestRecord, summarize
from bench.report import results_dir
from bench.workload import LengthDistribution, SyntheticWorkload, WorkloadRequest

logger = logging.getLogger(__name__)


async def _stream(backend, request: WorkloadRequest, request_id: str, record: RequestRecord, progress=None):
    async for num_tokens in backend.stream(request, request_id):
        record.add_chunk(time.perf_counter(), num_tokens)
        if progress is not None:
            progress()
    record.end_time = time.perf_counter()


async def measure_setting(
    target: str, streams: list[WorkloadRequest], long_request: WorkloadRequest, send_after_tokens: int
) -> dict:
    """Start `streams`, send `long_request` once each stream has `send_after_tokens` tokens, wait all."""
    from bench.backends.tandem_grpc import TandemBackend

    backend = TandemBackend(target, name="tandem")
    await backend.open()
    try:
        warm = WorkloadRequest(-1, streams[0].prompt_token_ids, 4)
        await _stream(backend, warm, "itl-warmup", RequestRecord(-1, warm.prompt_len, 4, time.perf_counter()))
        ready = asyncio.Event()
        records = [RequestRecord(r.index, r.prompt_len, r.output_len, time.perf_counter()) for r in streams]

        def check_ready() -> None:
            if all(rec.output_len >= send_after_tokens for rec in records):
                ready.set()

        start = time.perf_counter()
        tasks = [
            asyncio.create_task(_stream(backend, r, f"itl-stream-{r.index}", rec, check_ready))
            for r, rec in zip(streams, records, strict=True)
        ]
        await ready.wait()
        long_record = RequestRecord(
            long_request.index, long_request.prompt_len, long_request.output_len, time.perf_counter()
        )
        await _stream(backend, long_request, "itl-long-prompt", long_record)
        await asyncio.gather(*tasks)
    finally:
        await backend.close()
    points = sorted(
        (later - start, (later - earlier) * 1000.0)
        for rec in records
        for earlier, later in zip(rec.chunk_times[:-1], rec.chunk_times[1:], strict=True)
    )
    gaps = [gap / 1000.0 for _, gap in points]
    return {
        "itl_times_s": [round(t, 4) for t, _ in points],
        "itl_ms": [round(g, 2) for _, g in points],
        "itl_p99_ms": summarize(gaps)["p99"],
        "itl_max_ms": max(g for _, g in points),
        "long_prompt_sent_s": long_record.send_time - start,
        "long_prompt_first_token_s": long_record.chunk_times[0] - start if long_record.chunk_times else None,
        "long_prompt_ttft_ms": long_record.ttft * 1000.0 if long_record.chunk_times else None,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model dir (default: the cached default model)")
    parser.add_argument("--long-prompt-len", type=int, default=4096, help="tokens of the long prompt")
    parser.add_argument("--num-streams", type=int, default=8, help="running streams (default: 8)")
    parser.add_argument("--stream-output-len", type=int, default=160, help="tokens each stream generates")
    parser.add_argument("--send-after-tokens", type=int, default=20, help="stream tokens before it")
    parser.add_argument("--chunk-budget", type=int, default=512, help="max-num-batched-tokens when chunked")
    parser.add_argument("--threads", type=int, default=2, help="server threads (default: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=results_dir())


def run(args: argparse.Namespace) -> int:
    from bench import servers
    from bench.machine import machine_info
    from bench.plots import draw_chunked_prefill
    from bench.report import command_line, write_json
    from engine.model_store import resolve_model

    model_dir = resolve_model(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    streams = SyntheticWorkload(
        args.num_streams,
        LengthDistribution.parse("uniform:32:96"),
        LengthDistribution.parse(f"fixed:{args.stream_output_len}"),
        vocab,
        args.seed,
    ).requests()
    long_request = SyntheticWorkload(
        1,
        LengthDistribution.parse(f"fixed:{args.long_prompt_len}"),
        LengthDistribution.parse("fixed:8"),
        vocab,
        args.seed + 1,
    ).requests()[0]
    machine = machine_info()
    whole_prompt_budget = args.long_prompt_len + 64
    settings = []
    for label, budget in (("chunked prefill", args.chunk_budget), ("no chunking", whole_prompt_budget)):
        server_args = ["--max-num-batched-tokens", str(budget), "--max-num-seqs", "64"]
        server, target = servers.tandem_decode_server(
            f"itl-{budget}", str(model_dir), args.threads, server_args
        )
        with server:
            result = asyncio.run(measure_setting(target, streams, long_request, args.send_after_tokens))
        settings.append({"label": label, "max_num_batched_tokens": budget, **result})
        logger.info("%s: ITL p99 %.0f ms, max %.0f ms", label, result["itl_p99_ms"], result["itl_max_ms"])
    document = {
        "benchmark": "chunked_prefill",
        "machine": machine,
        "command": command_line(),
        "model": model_dir.name,
        "threads": args.threads,
        "num_streams": args.num_streams,
        "long_prompt_len": args.long_prompt_len,
        "settings": settings,
    }
    write_json(args.out_dir / "chunked_prefill.json", document)
    print(draw_chunked_prefill(document, args.out_dir))
    for setting in settings:
        print(
            f"{setting['label']}: ITL p99 {setting['itl_p99_ms']:.0f} ms, max "
            f"{setting['itl_max_ms']:.0f} ms, long prompt TTFT {setting['long_prompt_ttft_ms']:.0f} ms"
        )
    return 0
