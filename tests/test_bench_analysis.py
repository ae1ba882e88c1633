"""The benchmark's analysis pieces with known answers: batch-slot assignment from an event log, FLOP and
byte counts of the physical limit, the README table and plots from a result document, and the
llama-server SSE client against a fake server."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.backends.llama_server import LlamaServerBackend
from bench.backends.sse import HttpError, post_sse
from bench.occupancy import assign_slots
from bench.plots import draw_chunked_prefill, draw_comparison, draw_occupancy, readme_table
from bench.roofline import MachineProbe, ModelShape, WorkloadCost, rate_bound, throughput_bound
from bench.workload import WorkloadRequest
from decode_service.engine_core.step_record import ChunkRecord, StepRecord


def step(number, chunks, finished=(), preempted=()) -> StepRecord:
    return StepRecord(
        step=number,
        time=float(number),
        chunks=tuple(ChunkRecord(rid, n, kind) for rid, n, kind in chunks),
        num_free_blocks=0,
        num_waiting=0,
        preempted=tuple(preempted),
        finished=tuple(finished),
    )


def test_slots_are_filled_lowest_first_and_freed_on_finish():
    steps = [
        step(7, [("other-1", 5, "prefill")]),  # another run's request: ignored
        step(8, [("r-0", 10, "prefill"), ("r-1", 10, "prefill")]),
        step(9, [("r-0", 1, "decode"), ("r-1", 1, "decode")], finished=["r-0"]),
        step(10, [("r-1", 1, "decode"), ("r-2", 4, "prefill")]),
        step(11, [("r-1", 1, "decode"), ("r-2", 1, "decode"), ("r-warmup-0", 1, "decode")], finished=["r-1"]),
    ]
    result = assign_slots(steps, "r", num_slots=2)
    assert result["num_steps"] == 4
    assert sorted(result["segments"]) == sorted(
        [
            [0, 0, 1, 0, "prefill"],
            [0, 1, 1, 0, "decode"],
            [1, 0, 1, 1, "prefill"],
            [1, 1, 3, 1, "decode"],
            [0, 2, 1, 2, "prefill"],
            [0, 3, 1, 2, "decode"],  # request 2 reuses slot 0, freed by request 0
        ]
    )
    assert result["mean_occupancy"] == pytest.approx(1.0)


def test_a_preempted_request_gives_its_slot_back():
    steps = [
        step(0, [("r-0", 4, "prefill"), ("r-1", 4, "prefill")], preempted=["r-0"]),
        step(1, [("r-1", 1, "decode")]),
    ]
    result = assign_slots(steps, "r", num_slots=2)
    assert result["mean_occupancy"] == pytest.approx((2 + 1) / 4)


TINY = ModelShape(
    hidden=4, intermediate=8, layers=2, heads=2, kv_heads=1, head_dim=2, vocab=10, tied_embeddings=True
)


def test_model_shape_counts():
    # q and o: 2 * 4 * 2 * 2 = 32; k and v: 2 * 4 * 1 * 2 = 16; gated MLP: 3 * 4 * 8 = 96.
    assert TINY.layer_linear_macs == 144
    assert TINY.lm_head_macs == 40
    assert TINY.weight_bytes == 4 * (2 * 144 + 40)
    assert TINY.attention_macs(3) == 2 * 2 * 2 * 2 * 3
    assert TINY.kv_bytes(5) == 2 * 2 * 1 * 2 * 5 * 4


def test_workload_flops_and_bound():
    cost = WorkloadCost(prompt_lens=[3], output_lens=[2])
    # Forwarded tokens 3 + 2 - 1 = 4: linear 4 * 2 * 144, LM head 2 * 40, attention over 1+2+3+4 keys.
    assert cost.flops(TINY) == 2 * (4 * 288 + 80 + TINY.attention_macs(10))
    assert cost.min_decode_steps(max_batch=1) == 2
    assert WorkloadCost([1, 1], [5, 3]).min_decode_steps(max_batch=1) == 8
    assert WorkloadCost([1, 1], [5, 3]).min_decode_steps(max_batch=8) == 5
    # One decode token (j = 1) reads 3 + 1 = 4 cached positions.
    assert cost.kv_read_bytes(TINY) == TINY.kv_bytes(4)
    probe = MachineProbe(threads=1, read_bandwidth_gbs=1.0, matmul_gflops=1.0, matmul_gflops_by_shape={})
    limit = throughput_bound(TINY, probe, cost, max_batch=1)
    # At 1 GFLOP/s and 1 GB/s the larger of the two counts is the time bound, in nanoseconds.
    memory_bytes = 2 * TINY.weight_bytes + TINY.kv_bytes(4)
    assert limit["limited_by"] == ("compute" if cost.flops(TINY) >= memory_bytes else "memory")
    assert limit["output_tok_s_bound"] == pytest.approx(2e9 / max(cost.flops(TINY), memory_bytes), rel=1e-3)
    assert rate_bound({"output_tok_s_bound": 100.0, "mean_output_len": 10.0}, 4.0) == 40.0
    assert rate_bound({"output_tok_s_bound": 100.0, "mean_output_len": 10.0}, 40.0) == 100.0


def fake_run(name: str, tok_s: float, rate="inf") -> dict:
    quantiles = [float(i) for i in range(101)]
    summary = {"mean": 10.0, "p50": 9.0, "p90": 20.0, "p99": 30.0}
    return {
        "system": {"name": name},
        "arrivals": {"request_rate": rate},
        "metrics": {"output_throughput": tok_s, "ttft_ms": summary, "itl_ms": summary},
        "distributions": {"ttft_ms_quantiles": quantiles, "itl_ms_quantiles": quantiles},
    }


@pytest.fixture
def compare_document() -> dict:
    return {
        "machine": {
            "cpu": "Test CPU",
            "cores": 2,
            "memory_gib": 4.0,
            "load_average_1_5_15": [0.1, 0.2, 0.3],
            "date": "2026-01-01T00:00:00+00:00",
            "git_commit": "abc1234",
        },
        "command": "tandem bench compare",
        "config": {"model": "Tiny", "threads": 2, "baseline": "hf-static"},
        "workload": {
            "num_requests": 4,
            "prompt_len": "fixed:8",
            "output_len": "fixed:4",
            "seed": 0,
            "output_tokens": 16,
            "prompt_len_min": 8,
            "prompt_len_max": 8,
            "output_len_min": 4,
            "output_len_max": 4,
        },
        "physical_limit": {
            "output_tok_s_bound": 200.0,
            "mean_output_len": 4.0,
            "limited_by": "compute",
            "matmul_tflop": 1.0,
            "memory_read_gb": 2.0,
            "probe": {"matmul_gflops": 100.0, "read_bandwidth_gbs": 10.0},
        },
        "skipped": {"llama-server": "not built"},
        "runs": [fake_run("hf-static", 50.0), fake_run("tandem-aggregated", 100.0)],
        "sweep": [fake_run("tandem-aggregated", 30.0, 1.0), fake_run("tandem-aggregated", 60.0, 2.0)],
    }


def test_readme_table(compare_document):
    table = readme_table(compare_document)
    assert "| hf-static | 50.0 | 1.00x | 30 | 30 |" in table
    assert "| tandem-aggregated | 100.0 | 2.00x | 30 | 30 |" in table
    assert "physical limit (compute-bound) | 200.0" in table
    assert "tandem-aggregated reaches 50% of it" in table
    assert "Skipped llama-server: not built" in table
    assert "Measured hf-static, tandem-aggregated: 2026-01-01T00:00:00+00:00, commit abc1234" in table
    assert "command: `tandem bench compare`" in table


def test_plots_are_written(tmp_path, compare_document):
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(compare_document))
    written = draw_comparison(path, tmp_path)
    assert {p.name for p in written} == {"throughput_vs_rate.png", "cdf_ttft_itl.png", "README_table.md"}
    occupancy = {
        "num_requests": 2,
        "output_len": "fixed:4",
        "model": "Tiny",
        "modes": [
            {
                "batching": b,
                "num_slots": 2,
                "num_steps": 3,
                "mean_occupancy": 0.5,
                "segments": [[0, 0, 1, 0, "prefill"], [0, 1, 2, 0, "decode"]],
            }
            for b in ("static", "continuous")
        ],
    }
    chunked = {
        "num_streams": 2,
        "long_prompt_len": 64,
        "model": "Tiny",
        "threads": 1,
        "settings": [
            {
                "label": "chunked prefill",
                "max_num_batched_tokens": 16,
                "itl_times_s": [0.1, 0.2],
                "itl_ms": [5.0, 7.0],
                "itl_p99_ms": 7.0,
                "long_prompt_sent_s": 0.15,
                "long_prompt_first_token_s": 0.3,
            }
        ],
    }
    for picture in (draw_occupancy(occupancy, tmp_path), draw_chunked_prefill(chunked, tmp_path)):
        assert picture.stat().st_size > 1000
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def fake_llama_server(events: list[bytes], status: int = 200):
    """An HTTP/1.1 server answering one POST with `events` as a chunked SSE body."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        headers = b""
        while not headers.endswith(b"\r\n\r\n"):
            headers += await reader.read(1)
        length = int(
            next(
                line.split(b":")[1]
                for line in headers.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
        handle.body = json.loads(await reader.readexactly(length))
        writer.write(
            f"HTTP/1.1 {status} X\r\nContent-Type: text/event-stream\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )
        for event in events:
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", handle


def sse(payload) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def test_llama_backend_counts_tokens_and_asks_for_exact_greedy_output():
    async def scenario():
        events = [
            sse({"choices": [{"text": "Hel", "finish_reason": None}]}),
            # Two events in one TCP chunk, and one split across chunks.
            sse({"choices": [{"text": "lo", "finish_reason": None}]}) + b"data: " + b'{"choices": [{"te',
            b'xt": "", "finish_reason": null}]}\n\n',
            sse({"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 4}}),
            b"data: [DONE]\n\n",
        ]
        server, url, handler = await fake_llama_server(events)
        async with server:
            backend = LlamaServerBackend(url)
            counts = [n async for n in backend.stream(WorkloadRequest(0, (5, 6, 7), 4), "id-0")]
        return counts, handler.body

    counts, body = asyncio.run(scenario())
    # Three token events, then the usage count settles the one token the stream never showed.
    assert counts == [1, 1, 1, 1]
    assert body["prompt"] == [5, 6, 7]
    assert body["max_tokens"] == body["n_predict"] == 4
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["stream"] is True


def test_sse_client_raises_on_http_errors():
    async def scenario():
        server, url, _ = await fake_llama_server([b'{"error": "bad"}'], status=400)
        async with server:
            return [event async for event in post_sse(f"{url}/v1/completions", {})]

    with pytest.raises(HttpError, match="HTTP 400"):
        asyncio.run(scenario())


def test_update_keeps_the_runs_of_systems_not_measured_again(compare_document):
    from base.errors import TandemError
    from bench.compare import merge_documents

    current = {
        **compare_document,
        "machine": {**compare_document["machine"], "date": "2026-02-02T00:00:00+00:00"},
        "command": "tandem bench compare --update --systems tandem-aggregated",
        "skipped": {},
        "runs": [fake_run("tandem-aggregated", 120.0)],
        "sweep": [fake_run("tandem-aggregated", 40.0, 1.0)],
    }
    merged = merge_documents(compare_document, current, ["tandem-aggregated"])
    assert [(r["system"]["name"], r["metrics"]["output_throughput"]) for r in merged["runs"]] == [
        ("hf-static", 50.0),
        ("tandem-aggregated", 120.0),
    ]
    assert [r["metrics"]["output_throughput"] for r in merged["sweep"]] == [40.0]
    assert merged["skipped"] == {"llama-server": "not built"}
    sessions = [s["systems"] for s in merged["sessions"]]
    assert sessions == [["hf-static", "tandem-aggregated"], ["tandem-aggregated"]]
    table = readme_table(merged)
    assert "| tandem-aggregated | 120.0 | 2.40x |" in table
    assert "Measured hf-static: 2026-01-01" in table and "Measured tandem-aggregated: 2026-02-02" in table
    slower_probe = {**compare_document["physical_limit"], "output_tok_s_bound": 100.0}
    slower = {**current, "physical_limit": slower_probe}
    remerged = merge_documents(compare_document, slower, ["tandem-aggregated"])
    assert remerged["physical_limit"] == compare_document["physical_limit"]
    with pytest.raises(TandemError):
        merge_documents(compare_document, {**current, "workload": {"num_requests": 5}}, ["tandem-aggregated"])
