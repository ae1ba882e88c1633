"""`tandem bench serve` end to end: a tiny random model behind a real decode server on loopback, the
load generator over gRPC, and the JSON result file it writes (schema and exact token counts)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from conftest import tiny_hf_model
from tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer

from decode_service.config import DecodeServiceConfig
from decode_service.server import DecodeServer
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from tandem.cli import main

SAFETY_TIMEOUT = 60.0


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core box they thrash."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A decode server over a tiny model on its own event-loop thread; yields host:port."""
    model_dir = tmp_path_factory.mktemp("tiny-model")
    tiny_hf_model(3, vocab_size=TINY_VOCAB_SIZE).save_pretrained(model_dir)
    build_tiny_tokenizer(model_dir)
    engine_config = EngineConfig(
        cache=CacheConfig(block_size=8, num_blocks=256),
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    )
    engine = Engine.from_pretrained(model_dir, engine_config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(SAFETY_TIMEOUT)

    async def create() -> DecodeServer:
        return DecodeServer(engine, DecodeServiceConfig(host="127.0.0.1", port=0))

    server = call(create())
    port = call(server.start())
    yield f"127.0.0.1:{port}"
    call(server.stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(SAFETY_TIMEOUT)
    loop.close()


def summary_keys() -> set[str]:
    return {"mean", "p50", "p90", "p99"}


def test_bench_serve_writes_a_complete_result(target, tmp_path):
    result_file = tmp_path / "result.json"
    status = main(
        [
            "bench",
            "serve",
            "--target",
            target,
            "--num-prompts",
            "6",
            "--prompt-len",
            "uniform:4:20",
            "--output-len",
            "uniform:2:9",
            "--request-rate",
            "50",
            "--seed",
            "3",
            "--num-warmups",
            "1",
            "--goodput",
            "ttft:60000",
            "tpot:60000",
            "--result-file",
            str(result_file),
            "--no-progress",
        ]
    )
    assert status == 0
    result = json.loads(result_file.read_text())
    assert result["schema_version"] == 1
    assert result["benchmark"] == "serve"
    assert {"system", "workload", "arrivals", "metrics", "distributions", "machine", "command"} <= set(result)
    assert result["system"]["kind"] == "tandem" and result["system"]["vocab_size"] == TINY_VOCAB_SIZE
    expected_arrivals = {"request_rate": 50.0, "burstiness": 1.0, "max_concurrency": None, "warmups": 1}
    assert result["arrivals"] == expected_arrivals
    metrics = result["metrics"]
    workload = result["workload"]
    assert metrics["completed"] == 6 and metrics["failed"] == 0
    # ignore_eos with exact lengths: the server produced exactly what the workload asked for.
    assert metrics["output_len_mismatches"] == 0
    assert metrics["total_output_tokens"] == workload["output_tokens"]
    assert metrics["total_prompt_tokens"] == workload["prompt_tokens"]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(metrics[name]) == summary_keys()
        assert 0 <= metrics[name]["p50"] <= metrics[name]["p99"]
    assert metrics["ttft_ms"]["p99"] <= metrics["e2el_ms"]["p99"]
    # Generous SLOs: every request is good.
    assert metrics["goodput"]["good_requests"] == 6
    assert len(result["distributions"]["ttft_ms_quantiles"]) == 101
    assert result["machine"]["cores"] >= 1
    assert result["client"]["cpu_s"] >= 0


def test_bench_serve_counts_failures_and_exits_nonzero(target, tmp_path):
    # 300 output tokens on a 256-token context: the server refuses every request with INVALID_ARGUMENT.
    result_file = tmp_path / "result.json"
    status = main(
        [
            "bench",
            "serve",
            "--target",
            target,
            "--num-prompts",
            "2",
            "--prompt-len",
            "fixed:4",
            "--output-len",
            "fixed:300",
            "--num-warmups",
            "0",
            "--result-file",
            str(result_file),
            "--no-progress",
        ]
    )
    assert status == 1
    metrics = json.loads(result_file.read_text())["metrics"]
    assert metrics["completed"] == 0 and metrics["failed"] == 2
