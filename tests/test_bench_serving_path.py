"""`tandem bench serving-path` and its parts: CPU time read from /proc, py-spy stack summaries, the
near-zero model, and one small end-to-end run against a real server process."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import pytest
from tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer

from bench.near_zero_model import NearZeroModelSpec, tokenizer_source, write_near_zero_model
from bench.process_cpu import (
    ProcessCpuError,
    ThreadCpu,
    _parse_stat,
    process_cpu_seconds,
    thread_cpu_delta,
    thread_cpu_seconds,
)
from bench.pyspy_profile import summarize
from tandem.cli import main


def test_stat_line_with_spaces_and_parentheses_in_the_name_parses():
    ticks = os.sysconf("SC_CLK_TCK")
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    line = f"42 (a (b) c) S 1 42 42 0 -1 4194560 10 0 0 0 {3 * ticks} {ticks} 0 0 20 0 5 0 100\n"
    assert _parse_stat(line) == ("a (b) c", pytest.approx(4.0))


def test_own_cpu_time_grows_with_work_and_threads_are_listed():
    pid = os.getpid()
    before = process_cpu_seconds(pid)
    threads_before = thread_cpu_seconds(pid)
    worker_tid: list[int] = []

    busy = threading.Event()
    release = threading.Event()

    def spin() -> None:
        worker_tid.append(threading.get_native_id())
        # Its own CPU clock, not the process's: other threads of the test process may be busy too.
        while time.thread_time() < 0.1:
            sum(range(1000))
        busy.set()
        release.wait(30)

    worker = threading.Thread(target=spin)
    worker.start()
    assert busy.wait(30)
    threads_after = thread_cpu_seconds(pid)  # the worker is alive while we snapshot it
    release.set()
    worker.join()
    assert process_cpu_seconds(pid) > before
    rows = thread_cpu_delta(threads_before, threads_after, pid)
    assert worker_tid[0] in {row["tid"] for row in rows}
    assert all(row["name"] == "main" for row in rows if row["tid"] == pid)
    assert [row["cpu_s"] for row in rows] == sorted((row["cpu_s"] for row in rows), reverse=True)


def test_a_tokenizer_model_without_a_tokenizer_is_refused(tmp_path):
    from base.errors import ModelNotFoundError

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="no tokenizer.json"):
        tokenizer_source(str(tmp_path))


def test_a_missing_process_is_a_clear_error():
    with pytest.raises(ProcessCpuError, match="process 0"):
        process_cpu_seconds(0)


def test_thread_delta_counts_threads_born_between_snapshots_from_zero():
    before = {1: ThreadCpu(1, "python", 1.0)}
    after = {1: ThreadCpu(1, "python", 1.5), 7: ThreadCpu(7, "grpc", 0.25), 8: ThreadCpu(8, "idle", 0.0)}
    assert thread_cpu_delta(before, after, pid=1) == [
        {"tid": 1, "name": "main", "cpu_s": 0.5},
        {"tid": 7, "name": "grpc", "cpu_s": 0.25},
    ]


def test_profile_summary_counts_own_inclusive_and_per_thread_samples():
    stacks = [
        "thread (1): engine-loop;step (engine/engine.py:10);decode (detok.py:5) 30",
        "thread (1): engine-loop;step (engine/engine.py:12);decode (detok.py:7) 10",
        "thread (1): engine-loop;step (engine/engine.py:10) 20",
        "thread (2): MainThread;run (asyncio/events.py:80);step (engine/engine.py:3) 40",
    ]
    summary = summarize(stacks, duration_s=1.0, rate_hz=100)
    assert summary["samples"] == 100
    assert summary["threads"] == [
        {"thread": "engine-loop", "samples": 60, "busy_share": 0.6},
        {"thread": "MainThread", "samples": 40, "busy_share": 0.4},
    ]
    own = {row["function"]: row["samples"] for row in summary["top_own"]}
    # Samples at different lines of one function add up; a stack's leaf is its own time.
    assert own == {"decode (detok.py)": 40, "step (engine/engine.py)": 60}
    inclusive = {row["function"]: row["samples"] for row in summary["top_inclusive"]}
    # A function twice on one stack (recursion, or here two threads' frames) counts once per stack.
    assert inclusive["step (engine/engine.py)"] == 100
    assert inclusive["run (asyncio/events.py)"] == 40
    assert {row["file"]: row["share"] for row in summary["own_by_file"]} == {
        "engine/engine.py": 0.6,
        "detok.py": 0.4,
    }


def test_near_zero_model_has_the_spec_shape_and_the_tokenizer(tmp_path):
    from engine.config import CacheConfig, EngineConfig
    from engine.engine import Engine

    source = tmp_path / "source"
    source.mkdir()
    build_tiny_tokenizer(source)
    (source / "config.json").write_text(json.dumps({"vocab_size": TINY_VOCAB_SIZE, "eos_token_id": 2}))
    spec = NearZeroModelSpec(num_layers=2, hidden_size=32, vocab_size=TINY_VOCAB_SIZE - 8)
    model_dir = write_near_zero_model(tmp_path / "model", source, spec)
    engine = Engine.from_pretrained(model_dir, EngineConfig(cache=CacheConfig(block_size=8, num_blocks=16)))
    assert engine.model_config.num_layers == 2 and engine.model_config.hidden_size == 32
    assert engine.vocab_size == TINY_VOCAB_SIZE - 8
    assert (model_dir / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert engine.tokenizer.decode(engine.tokenizer.encode("hello")) == "hello"
    # A vocabulary above the tokenizer's (the bench's default 1,024 over the tiny 512) takes the tokenizer's.
    wide = write_near_zero_model(tmp_path / "wide", source, NearZeroModelSpec(vocab_size=TINY_VOCAB_SIZE * 2))
    assert json.loads((wide / "config.json").read_text())["vocab_size"] == TINY_VOCAB_SIZE


@pytest.mark.slow
def test_serving_path_bench_measures_a_real_server(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    build_tiny_tokenizer(source)
    (source / "config.json").write_text(json.dumps({"vocab_size": TINY_VOCAB_SIZE, "eos_token_id": 2}))
    result_file = tmp_path / "serving_path.json"
    flags = {
        "--streams": "4",
        "--output-len": "30",
        "--prompt-len": "5",
        "--rounds": "2",
        "--stream-interval": "2",
        "--tokenizer-model": str(source),
        "--result-file": str(result_file),
    }
    status = main(["bench", "serving-path", *(part for pair in flags.items() for part in pair)])
    assert status == 0
    result = json.loads(result_file.read_text())
    assert result["benchmark"] == "serving_path" and result["server"]["stream_interval"] == 2
    assert [r["tokens"] for r in result["rounds"]] == [120, 120]
    # CPU time comes in 10 ms clock ticks: a round may show none, both rounds together must show some.
    assert all(r["failed"] == 0 and r["server_cpu_s"] >= 0 for r in result["rounds"])
    # Stream interval 2 over 30 tokens: the first and the last alone, the rest in pairs (or more, merged
    # when a writer fell behind), so at least 30 / 16 tokens per message.
    assert all(r["tokens_per_message"] >= 30 / 16 for r in result["rounds"])
    summary = result["summary"]
    assert summary["server_cpu_us_per_token"] > 0 and summary["served_tok_s"] > 0
    floor = result["engine_floor"]
    assert floor["engine_loop_alone"]["tokens"] == 120
    assert floor["decode_step_cpu_us_per_token"]["batch"] == 4
    assert result["model"]["vocab_size"] == TINY_VOCAB_SIZE and result["model"]["num_layers"] == 3
    bounds = result["bounds"]
    assert bounds["lm_head"]["vocab"] == TINY_VOCAB_SIZE and bounds["lm_head"]["rows"] == 4
    assert bounds["grpc_write"]["streams"] == 4 and bounds["grpc_write"]["messages_per_stream"] == 30
    assert (tmp_path / "serving_path.png").stat().st_size > 0
    # A few dozen messages may take less CPU than one clock tick: only the bigger figure must show.
    assert summary["grpc_write_floor_cpu_us_per_message"] >= 0
    assert summary["lm_head_floor_cpu_us_per_token"] > 0


def test_http_api_is_refused_clearly_when_the_server_has_none(monkeypatch, tmp_path, caplog):
    import bench.serving_path as serving_path

    monkeypatch.setattr(serving_path, "_server_supports", lambda flag: False)
    status = main(["bench", "serving-path", "--api", "http", "--result-file", str(tmp_path / "r.json")])
    assert status == 2
    assert "no HTTP API" in caplog.text
    assert not (tmp_path / "r.json").exists()


def test_server_cpu_splits_into_model_math_engine_python_and_edge():
    from bench.serving_path import split_server_cpu

    floor = {
        "engine_loop_alone": {"cpu_us_per_token": 110.0},
        "decode_step_cpu_us_per_token": {"forward_with_prepare": 64.5, "lm_head_and_sampler": 14.5},
    }
    split = split_server_cpu(160.0, floor)
    assert split == {
        "engine_loop_alone_cpu_us_per_token": 110.0,
        "model_math_cpu_us_per_token": 79.0,
        "engine_python_cpu_us_per_token": 31.0,
        "edge_cpu_us_per_token": 50.0,
        "serving_path_own_cpu_us_per_token": 81.0,
    }
    layers = ("model_math", "engine_python", "edge")
    assert sum(split[f"{name}_cpu_us_per_token"] for name in layers) == 160.0


def test_lm_head_floor_is_the_head_flops_at_the_measured_gemm_rate():
    from bench.serving_bounds import lm_head_floor

    floor = lm_head_floor(rows=8, hidden=32, vocab=3000, threads=1, repeats=3)
    assert floor["gemm_gflop_per_s"] > 0
    expected_us = 1e6 * 2 * 32 * 3000 / (floor["gemm_gflop_per_s"] * 1e9)
    assert floor["cpu_us_per_token"] == pytest.approx(expected_us, abs=0.06)


def test_bare_grpc_server_streams_every_message_and_its_cpu_is_read():
    import asyncio

    from bench.servers import ServerProcess, free_port, grpc_healthy, running
    from bench.serving_bounds import _drive, grpc_write_floor

    port = free_port()
    target = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "bench.serving_bounds", "--port", str(port)]
    with running(ServerProcess("bare-grpc-test", command, lambda: grpc_healthy(target))):
        assert asyncio.run(_drive(target, streams=3, messages=5)) == 15
    floor = grpc_write_floor(streams=2, messages=4, rounds=1)
    assert floor["streams"] == 2 and floor["server_cpu_us_per_message"] >= 0


def test_perf_report_cites_the_floors_measured_in_the_same_run():
    from bench.perf_report import _floors_note

    note = _floors_note({"grpc_write_floor_cpu_us_per_message": 20.4, "lm_head_floor_cpu_us_per_token": 36.2})
    assert "bare grpc.aio server spends 20 µs per stream message" in note
    assert "LM head alone needs 36 µs/token" in note
    assert _floors_note({}) == ""


def test_the_plot_sets_each_round_beside_the_bare_servers_and_needs_a_bare_run(tmp_path):
    from bench.plots import draw_serving_path

    def rounds(rates: list[float], cpu: float) -> list[dict]:
        return [{"served_tok_s": rate, "server_cpu_us_per_token": cpu} for rate in rates]

    result = {
        "summary": {"msgs_per_s_vs_bare": 0.7, "cpu_per_message_vs_bare": 2.5},
        "rounds": rounds([20_000, 22_000], 50.0),
        "bare_grpc": {
            "msgs_per_s": 30_000,
            "cpu_us_per_message": 20.0,
            "rounds": rounds([30_000, 31_000], 20.0),
        },
        "workload": {"streams": 128, "output_len": 128, "api": "grpc"},
        "model": {"vocab_size": 1024},
        "machine": {"date": "2026-12-02T09:00:00+00:00"},
    }
    path = draw_serving_path(result, tmp_path)
    assert path == tmp_path / "serving_path.png" and path.stat().st_size > 0
    assert draw_serving_path({**result, "bare_grpc": None}, tmp_path / "none") is None
