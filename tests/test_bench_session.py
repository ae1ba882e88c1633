"""bench.session: the header, skipping and writing every comparison command shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import compare, session
from bench.servers import ServerStartError


@pytest.fixture
def quiet(monkeypatch) -> None:
    """A fixed machine: no torch import, no bandwidth probe, no git."""
    monkeypatch.setattr("bench.machine.machine_info", lambda: {"cpu": "Xeon", "cores": 2})
    monkeypatch.setattr("bench.machine.git_commit", lambda: "abc1234")
    monkeypatch.setattr("bench.machine.load_average", lambda: [0.25, 0.5, 0.75])


def test_the_header_holds_the_machine_host_command_commit_and_load(quiet) -> None:
    document = session.header("gemma", None, model="m", runs=[])
    assert document["benchmark"] == "gemma" and document["commit"] == "abc1234"
    assert document["host"] == "Xeon, 2 cores" and document["load_average_at_start"] == [0.25, 0.5, 0.75]
    assert document["command"] and document["started"] and document["model"] == "m"
    assert session.header("gemma", [2.0, 1.0, 1.0])["load_average_at_start"] == [2.0, 1.0, 1.0]


def test_a_busy_machine_is_refused_unless_allowed(monkeypatch) -> None:
    monkeypatch.setattr("bench.machine.load_average", lambda: [1.5, 1.0, 1.0])
    with pytest.raises(SystemExit, match="load average 1.50 > 1.0"):
        session.quiet_machine(allow_load=False)
    assert session.quiet_machine(allow_load=True) == ([1.5, 1.0, 1.0], False)


def test_a_system_that_cannot_run_is_skipped_with_its_reason() -> None:
    def measure(name: str) -> dict:
        if name == "unbuilt":
            raise compare.SystemSkipped("llama.cpp not built")  # compare's serving raises these
        if name == "broken":
            raise ServerStartError("exited with 1")
        return {"system": name}

    runs, skipped = session.each_system(["a", "unbuilt", "broken", "b"], measure)
    assert runs == [{"system": "a"}, {"system": "b"}]
    assert skipped == {"unbuilt": "llama.cpp not built", "broken": "exited with 1"}


def test_finish_writes_the_json_and_the_readme_table_and_prints_it(quiet, tmp_path: Path, capsys) -> None:
    document = {"benchmark": "gemma", "runs": [{"system": "a"}]}
    drawn = []

    def draw(doc: dict, out: Path) -> Path:
        drawn.append(out)
        return out / "gemma.png"

    path = session.finish(document, tmp_path / "out", lambda doc: "| a |\n", draw)
    assert path == tmp_path / "out" / "gemma.json"
    written = json.loads(path.read_text())
    assert written["load_average_at_end"] == [0.25, 0.5, 0.75] and written["runs"] == [{"system": "a"}]
    assert (tmp_path / "out" / "README_gemma_table.md").read_text() == "| a |\n"
    assert drawn == [tmp_path / "out"] and "| a |" in capsys.readouterr().out
    # No table without runs, and a file name of its own where a command has several.
    assert (
        session.finish({"benchmark": "x", "runs": []}, tmp_path, lambda doc: "t", name="x_2").name
        == "x_2.json"
    )
    assert not (tmp_path / "README_x_2_table.md").exists()
