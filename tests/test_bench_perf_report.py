"""`tandem bench perf-report`: target verdicts, the markdown table, the JSON shape, the load refusal, and a
tiny quick report end to end."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from bench import perf_report, perf_targets
from bench.perf_targets import Figure, Target

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("target", "value", "met"),
    [
        (Target("<=", 60.0), 59.9, True),
        (Target("<=", 60.0), 60.0, True),
        (Target("<=", 60.0), 60.1, False),
        (Target(">=", 1.0), 0.56, False),
        (Target(">=", 1.0), 1.0, True),
        (Target(">=", 15_000.0), None, None),
    ],
)
def test_target_verdict(target: Target, value: float | None, met: bool | None) -> None:
    assert target.met(value) is met


def test_target_refuses_unknown_operator() -> None:
    with pytest.raises(ValueError, match="operator"):
        Target("<", 1.0)


def test_target_prints_as_the_issue_writes_it() -> None:
    assert str(perf_targets.SERVED_TOK_S) == "≥ 15,000"
    assert str(perf_targets.SERVER_CPU_PER_TOKEN) == "≤ 60.0"


def test_issue_targets_are_the_issues() -> None:
    assert (perf_targets.SERVER_CPU_PER_TOKEN.op, perf_targets.SERVER_CPU_PER_TOKEN.threshold) == ("<=", 60)
    assert perf_targets.SERVED_TOK_S.threshold == 15_000
    assert perf_targets.SINGLE_STREAM_RATIO.threshold == 1.0
    assert perf_targets.KV_GBPS_AT_4K.threshold == 1.0
    assert (perf_targets.DISAGG_TTFT_RATIO.op, perf_targets.DISAGG_TTFT_RATIO.threshold) == ("<=", 1.2)
    assert perf_targets.HEADLINE_RATIO.threshold == 2.0
    before = perf_targets.SERVING_PATH_BEFORE
    assert (before["server_cpu_us_per_token"], before["served_tok_s"]) == (365.0, 2242.0)
    assert "2026-11-30" in before["source"]


def _report(figures: list[Figure], **overrides) -> dict:
    report = {
        "schema_version": perf_targets.SCHEMA_VERSION,
        "benchmark": "perf_report",
        "command": "tandem bench perf-report",
        "machine": {"cpu": "test cpu", "cores": 2, "date": "2026-11-30T15:40:00+00:00", "git_commit": "abc"},
        "load_average_before": [0.3, 0.4, 0.5],
        "load_average_after": [1.9, 1.2, 0.8],
        "valid": True,
        "invalid_reason": None,
        "quick": False,
        "sections_run": ["serving", "headline"],
        "duration_s": 700.0,
        "figures": perf_targets.figure_rows(figures),
        "sections": {},
        "skipped": {},
    }
    return {**report, **overrides}


FIGURES = [
    Figure("serving", "server CPU per token, grpc", 48.5, "µs", perf_targets.SERVER_CPU_PER_TOKEN, 365.0),
    Figure(
        "serving", "served tok/s, grpc", 9_800.0, "tok/s", perf_targets.SERVED_TOK_S, 2242.0, "bound: CPU"
    ),
    Figure("single", "TTFT p50, llama-server", 210.0, "ms"),
    Figure("headline", "ratio", None, "x", perf_targets.HEADLINE_RATIO),
]


def test_figure_rows_carry_the_verdict() -> None:
    rows = perf_targets.figure_rows(FIGURES)
    assert [row["met"] for row in rows] == [True, False, None, None]
    assert rows[0]["target"] == "≤ 60.0"
    assert rows[2]["target"] is None


def test_markdown_lists_every_figure_with_target_and_verdict() -> None:
    markdown = perf_targets.render_markdown(_report(FIGURES))
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(FIGURES)  # header and one row per figure
    cpu, tok_s, ttft, ratio = table[1:]
    assert "| 365 µs | 48.5 µs | ≤ 60.0 | met |" in cpu
    assert "| 2,242 tok/s | 9,800 tok/s | ≥ 15,000 | **not met** | bound: CPU |" in tok_s
    assert "| 210 ms |  |  |" in ttft
    assert "not measured" in ratio
    assert "before [0.3, 0.4, 0.5], after [1.9, 1.2, 0.8]; run valid" in markdown


def test_markdown_says_why_a_run_is_not_valid_and_what_was_not_run() -> None:
    report = _report(
        FIGURES, valid=False, invalid_reason="load 3.2 at start", skipped={"kv": "RuntimeError: boom"}
    )
    markdown = perf_targets.render_markdown(report)
    assert "**not valid**: load 3.2 at start" in markdown
    assert "- kv not run: RuntimeError: boom" in markdown


def test_report_matches_the_schema() -> None:
    report = json.loads(json.dumps(_report(FIGURES)))
    jsonschema.validate(report, perf_targets.REPORT_SCHEMA)


@pytest.mark.parametrize(
    ("field", "wrong"),
    [
        ("sections_run", ["serving", "gpu"]),
        ("load_average_before", [0.1]),
        ("valid", "yes"),
        ("benchmark", "compare"),
    ],
)
def test_schema_rejects_a_wrong_field(field: str, wrong: object) -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(_report(FIGURES, **{field: wrong}), perf_targets.REPORT_SCHEMA)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    perf_report.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_unknown_section_is_refused() -> None:
    with pytest.raises(SystemExit, match="unknown sections: gpu"):
        perf_report.run(_args("--sections", "serving,gpu"))


def test_refuses_a_loaded_machine_without_allow_load(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("bench.machine.load_average", lambda: [3.5, 2.0, 1.0])
    assert perf_report.run(_args("--sections", "headline", "--out-dir", str(tmp_path))) == 2
    assert not (tmp_path / "perf_report.json").exists()


def test_headline_from_file_under_load_is_written_but_not_valid(monkeypatch, tmp_path) -> None:
    compare = {
        "workload": {"num_requests": 64},
        "physical_limit": {"output_tok_s_bound": 300.0, "limited_by": "compute"},
        "runs": [
            {"system": {"name": "tandem-aggregated"}, "metrics": {"output_throughput": 180.0}},
            {"system": {"name": "llama-server"}, "metrics": {"output_throughput": 120.0}},
        ],
    }
    compare_file = tmp_path / "compare.json"
    compare_file.write_text(json.dumps(compare))
    monkeypatch.setattr("bench.machine.load_average", lambda: [3.5, 2.0, 1.0])
    args = _args(
        *("--sections", "headline", "--headline-from-file", "--allow-load"),
        *("--compare-file", str(compare_file), "--out-dir", str(tmp_path)),
    )
    assert perf_report.run(args) == 0
    report = json.loads((tmp_path / "perf_report.json").read_text())
    jsonschema.validate(report, perf_targets.REPORT_SCHEMA)
    assert report["valid"] is False and "3.5" in report["invalid_reason"]
    ratio = report["figures"][-1]
    assert (ratio["value"], ratio["met"]) == (1.5, False)
    assert "physical limit 300 tok/s" in ratio["note"]
    assert "| output tok/s, tandem / llama-server F32 |" in (tmp_path / "perf_report.md").read_text()


def test_a_failing_section_is_recorded_and_the_others_kept(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr("bench.machine.load_average", lambda: [0.1, 0.1, 0.1])
    args = _args(
        *("--sections", "headline", "--headline-from-file"),
        *("--compare-file", str(tmp_path / "missing.json"), "--out-dir", str(tmp_path)),
    )
    assert perf_report.run(args) == 1
    report = json.loads((tmp_path / "perf_report.json").read_text())
    assert report["valid"] is False
    assert "FileNotFoundError" in report["skipped"]["headline"]


@pytest.mark.slow
def test_quick_serving_report_end_to_end(tmp_path) -> None:
    """A real, sized-down serving section through the CLI: the server starts, the figures come back."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [
        *(sys.executable, "-m", "tandem.cli", "bench", "perf-report", "--quick", "--allow-load"),
        *("--sections", "serving", "--serving-apis", "grpc", "--out-dir", str(tmp_path)),
    ]
    subprocess.run(command, cwd=REPO, env=env, check=True, timeout=600, capture_output=True)
    report = json.loads((tmp_path / "perf_report.json").read_text())
    jsonschema.validate(report, perf_targets.REPORT_SCHEMA)
    names = [row["name"] for row in report["figures"]]
    assert names == ["server CPU per token, grpc 16 streams", "served tok/s, grpc 16 streams"]
    assert all(row["value"] > 0 for row in report["figures"])
    assert report["figures"][0]["before"] is None  # the issue's "before" is of 128 streams, not 16
