"""`tandem bench quantized`: the ratios and the README table it writes, and how it starts llama-server."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from pathlib import Path

import pytest

from bench import plots, quantized, servers, session


def _run(system: str, single: float, chat: float, ttft: float, headline: float) -> dict:
    return {
        "system": system,
        "label": quantized.LABELS[system],
        "single_decode_tok_s": single,
        "multi_turn_tok_s": chat,
        "multi_turn_median_ttft_ms": ttft,
        "headline_tok_s": headline,
        "peak_rss_bytes": 700 * 2**20,
    }


def _document(runs: list[dict], valid: bool = True) -> dict:
    return {
        "runs": runs,
        "ratios": quantized.ratios(runs),
        "workloads": {
            "chat": {"conversations": 4, "turns": 4, "system_len": 512, "user_len": 48, "reply_len": 32},
            "single": {"num_requests": 4, "prompt_len": "uniform:60:330", "output_len": "fixed:256"},
            "headline": {"num_requests": 64, "prompt_len": "uniform:60:330", "output_len": "uniform:16:256"},
        },
        "machine": {"cpu": "Xeon", "cores": 2},
        "model": "SmolLM2-135M-Instruct",
        "threads": 2,
        "started": "2026-12-01T20:00:00+00:00",
        "commit": "abc1234",
        "load_average_at_start": [0.2, 0.3, 0.4],
        "load_average_at_end": [1.9, 1.2, 0.8],
        "valid": valid,
        "command": "tandem bench quantized",
    }


def test_ratios_are_tandem_int8_over_llama_q8_0_and_absent_without_both() -> None:
    runs = [
        _run("tandem-aggregated-int8", 60.0, 90.0, 300.0, 400.0),
        _run("llama-server-q8_0", 50.0, 30.0, 1200.0, 100.0),
    ]
    assert quantized.ratios(runs) == {
        "single_decode": 1.2,
        "multi_turn_throughput": 3.0,
        "multi_turn_median_ttft": 0.25,
        "headline_throughput": 4.0,
    }
    assert quantized.ratios(runs[:1]) is None


def test_the_table_has_a_row_per_system_and_says_when_the_machine_was_busy() -> None:
    runs = [
        _run("tandem-aggregated", 40.0, 80.0, 350.0, 180.0),
        _run("tandem-aggregated-int8", 60.0, 90.0, 300.0, 400.0),
        _run("llama-server-q8_0", 50.0, 30.0, 1200.0, 100.0),
    ]
    text = plots.quantized_table(_document(runs))
    assert "| tandem fp32 | 40.0 | 80.0 | 350 | 180.0 | 700 |" in text
    assert "| llama-server Q8_0 | 50.0 | 30.0 | 1,200 | 100.0 | 700 |" in text
    assert "single-stream decode 1.20x" in text and "all-at-once 4.00x" in text
    assert "commit abc1234" in text and "not a valid comparison" not in text
    assert "4 conversations x 4 turns" in text and "64 requests, prompts uniform:60:330" in text
    assert "not a valid comparison" in plots.quantized_table(_document(runs, valid=False))


def test_unknown_systems_are_refused() -> None:
    with pytest.raises(SystemExit, match="unknown systems: tandem-int4"):
        session.systems("tandem-aggregated,tandem-int4", quantized.SYSTEMS)
    assert session.systems(" llama-server,tandem-aggregated,", quantized.SYSTEMS) == [
        "llama-server",
        "tandem-aggregated",
    ]


def test_peak_rss_reads_each_process_high_water_mark() -> None:
    own = session.peak_rss_bytes([os.getpid()])
    assert own > 10 * 2**20
    assert session.peak_rss_bytes([os.getpid(), os.getpid()]) == 2 * own
    assert session.peak_rss_bytes([2**22 + 7]) == 0  # gone: counted as nothing


def test_llama_server_runs_q8_0_without_repacking() -> None:
    q8, _ = servers.llama_server("q8", Path("llama-server"), Path("m.Q8_0.gguf"), 2, 16, 16384)
    f32, _ = servers.llama_server("f32", Path("llama-server"), Path("m.F32.gguf"), 2, 16, 16384)
    assert "--no-repack" in q8.command and "--no-repack" not in f32.command
    assert q8.command[q8.command.index("-np") + 1] == "16" and "-cb" in q8.command


def test_decode_args_reach_every_tandem_server(monkeypatch) -> None:
    """`--decode-args` goes, split as a shell would, after the flags the tandem system gets anyway."""
    started = []

    def tandem_decode_server(name, model, threads, server_args, prefill_target=None):
        started.append(server_args)
        return contextlib.nullcontext(), "localhost:1"

    monkeypatch.setattr(servers, "tandem_decode_server", tandem_decode_server)
    parser = argparse.ArgumentParser()
    quantized.add_arguments(parser)
    args = parser.parse_args(["--decode-args", "--max-prefills-per-step 1"])
    with quantized.serving("tandem-aggregated-int8", args, "model") as (_, _, extra):
        pass
    (server_args,) = started
    assert extra["server_args"] == server_args
    assert server_args[-4:] == ["--max-prefills-per-step", "1", "--quantization", "int8"]


def test_each_server_runs_single_one_at_a_time_and_the_headline_all_at_once(monkeypatch) -> None:
    """What `measure_system` hands `bench.serve.measure` for the single-stream and headline runs."""
    calls = []

    @contextlib.contextmanager
    def serving(name, args, model):
        yield "tandem", "localhost:1", {"pid": 1}

    class ChatClient:
        async def complete(self, prompt, max_tokens):
            yield "token"

        async def close(self):
            pass

    async def run_conversations(client, workload):
        return [], 1.0

    async def measure(backend, args, arrivals, show_progress, extra, workload, max_concurrency=None):
        calls.append((workload, max_concurrency, arrivals.rate))
        return {
            "metrics": {
                "tpot_ms": {"p50": 20.0},
                "ttft_ms": {"p50": 100.0},
                "output_throughput": 9.0,
                "failed": 0,
            }
        }

    monkeypatch.setattr(quantized, "serving", serving)
    monkeypatch.setattr(quantized, "_chat_client", lambda kind, target: ChatClient())
    monkeypatch.setattr(session, "server_pids", list)
    monkeypatch.setattr("bench.multi_turn.run_conversations", run_conversations)
    monkeypatch.setattr(
        "bench.multi_turn.summarize",
        lambda turns, wall_s: {"output_throughput": 5.0, "median_ttft_ms_turns_2_plus": 50.0},
    )
    monkeypatch.setattr("bench.serve.make_backend", lambda kind, target, label: object())
    monkeypatch.setattr("bench.serve.measure", measure)
    workloads = {"chat": "chat", "single": "single", "headline": "headline"}
    result = quantized.measure_system("tandem-aggregated", None, Path("model"), workloads)
    assert calls == [("single", 1, math.inf), ("headline", None, math.inf)]
    assert result["single_decode_tok_s"] == 50.0 and result["headline_tok_s"] == 9.0


def test_alternated_single_stream_sends_the_workload_to_each_server_in_turn(monkeypatch) -> None:
    """Both servers stay up; each round measures tandem, then llama-server, and keeps their ratio."""
    started, sent = [], []

    @contextlib.contextmanager
    def serving(name, args, model):
        started.append(name)
        yield name, f"target-{name}", {}

    tpot = iter([10.0, 12.5, 20.0, 20.0, 8.0, 10.0])

    def at_once(backend, workload, extra, max_concurrency=None):
        sent.append((backend, workload, max_concurrency))
        return {"tpot_ms": {"p50": next(tpot)}}

    monkeypatch.setattr(quantized, "serving", serving)
    monkeypatch.setattr(session, "at_once", at_once)
    monkeypatch.setattr("bench.serve.make_backend", lambda kind, target, label: target)
    found = quantized.alternate_single(None, Path("model"), "single", 3)
    assert started == [quantized.TANDEM, quantized.PEER]
    pair = [f"target-{quantized.TANDEM}", f"target-{quantized.PEER}"]
    assert [backend for backend, _, _ in sent] == pair * 3
    assert {(workload, concurrency) for _, workload, concurrency in sent} == {("single", 1)}
    assert [round(row["ratio"], 3) for row in found["rounds"]] == [1.25, 1.0, 1.25]
    assert found["median_ratio"] == pytest.approx(1.25) and found["min_ratio"] == pytest.approx(1.0)


def test_the_table_reports_the_alternated_single_stream_when_measured() -> None:
    runs = [_run("tandem-aggregated-int8", 80, 60, 350, 180), _run("llama-server-q8_0", 100, 50, 800, 140)]
    document = _document(runs)
    assert "in turn" not in plots.quantized_table(document)
    document["single_alternated"] = {
        "rounds": [{"ratio": 0.93}, {"ratio": 0.97}, {"ratio": 0.95}],
        "median_ratio": 0.95,
        "min_ratio": 0.93,
        "max_ratio": 0.97,
    }
    table = plots.quantized_table(document)
    assert "each in turn 3 times: tandem int8 / llama-server Q8_0 median 0.95x (rounds 0.93-0.97x)" in table
