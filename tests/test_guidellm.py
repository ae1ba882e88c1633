"""guidellm 0.8.1 (vLLM's load generator) from PyPI, unmodified, against `tandem serve decode --http-port`:
the multi-turn chat scenario of bench/guidellm_scenario.json, sized down, must end with no errored request.

guidellm sends what vLLM accepts: chat messages with content as a list of text parts, the history of
earlier turns, `max_completion_tokens` with `ignore_eos`, and `stream_options` with both `include_usage`
and vLLM's `continuous_usage_stats`; it finds the model through /v1/models and counts tokens from the
usage the server reports. Skipped where guidellm is not installed (it comes with the `bench` extra).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import save_tiny_model, wait_until

from bench.servers import free_port, running, tandem_decode_server

pytestmark = pytest.mark.slow

GUIDELLM = Path(sys.executable).with_name("guidellm")
TURNS = 3
REQUESTS = 6
OUTPUT_TOKENS = 8


def http_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


def small_scenario(repo_root: Path, target: str, tokenizer: Path, report: Path) -> dict:
    """The shipped scenario, pointed at this server and sized to a few requests."""
    scenario = json.loads((repo_root / "bench" / "guidellm_scenario.json").read_text())
    spec = scenario["spec"]
    spec["backend"]["target"] = target
    spec["tokenizer"]["model"] = str(tokenizer)
    spec["profile"]["streams"] = 2
    spec["data"][0].update(
        prompt_tokens=24, output_tokens=OUTPUT_TOKENS, turns=TURNS, prefix_tokens=8, prefix_count=2
    )
    spec["constraints"] = [{"kind": "max_requests", "count": REQUESTS}]
    spec["outputs"] = [{"kind": "json", "path": str(report)}]
    return scenario


def test_guidellm_multi_turn_chat_runs_with_no_errored_request(tmp_path, repo_root):
    if importlib.util.find_spec("guidellm") is None or not GUIDELLM.is_file():
        pytest.skip("guidellm is not installed (pip install guidellm==0.8.1, or the project's bench extra)")
    model = tmp_path / "model"
    save_tiny_model(model, 3)
    http_port = free_port()
    target = f"http://127.0.0.1:{http_port}"
    server, _ = tandem_decode_server(
        "guidellm-decode", str(model), 1, ["--http-port", str(http_port), "--max-num-seqs", "8"]
    )
    report = tmp_path / "guidellm.json"
    scenario = tmp_path / "scenario.json"
    scenario.write_text(json.dumps(small_scenario(repo_root, target, model, report)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with running(server):
        assert wait_until(lambda: http_ready(f"{target}/health"), 60)
        done = subprocess.run(
            [str(GUIDELLM), "run", "-c", str(scenario), "--disable-progress"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    totals = benchmark["metrics"]["request_totals"]
    errors = [request["info"]["error"] for request in benchmark["requests"]["errored"]]
    assert totals["errored"] == 0 and totals["incomplete"] == 0, errors[:3]
    successful = benchmark["requests"]["successful"]
    assert totals["successful"] == len(successful) == REQUESTS
    assert {request["info"]["turn_index"] for request in successful} == set(range(TURNS))
    # Tokens as the server's usage reported them: exactly what was asked for (ignore_eos).
    assert all(request["output_tokens"] == OUTPUT_TOKENS for request in successful)
