"""The generated configuration table (`tandem.config_docs`): complete, faithful to the parsers, and
README.md kept in step with it."""

from __future__ import annotations

import argparse

import pytest

from base.settings import Settings
from tandem.cli import build_parser
from tandem.config_docs import (
    COMMANDS,
    END_MARKER,
    EXIT_NO_MARKERS,
    EXIT_STALE,
    START_MARKER,
    _table,
    flag_rows,
    main,
    render,
)


def _subparser(parser: argparse.ArgumentParser, path) -> argparse.ArgumentParser:
    for name in path:
        parser = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return parser


def test_every_flag_of_every_documented_command_has_a_row():
    block = render()
    sections = block.split("#### ")
    parser = build_parser()
    for path in COMMANDS:
        section = next(s for s in sections if s.startswith(f"`tandem {' '.join(path)}`"))
        for action in _subparser(parser, path)._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"| `{option}` |" in section, (path, option)
    assert block.startswith(START_MARKER) and block.endswith(END_MARKER)


def test_rows_show_defaults_and_help_as_the_parser_declares_them():
    parser = argparse.ArgumentParser(prog="demo")
    parser.add_argument("name", metavar="NAME", help="who")
    parser.add_argument("--model", required=True, help="a model")
    parser.add_argument("--port", type=int, default=7, help="port (default: %(default)s)")
    parser.add_argument("--mode", default="a", choices=["a", "b"], help="a | b")
    parser.add_argument("--fast", action="store_true", help="go fast")
    parser.add_argument("--limit", type=int, default=None, help="limit")
    assert flag_rows(parser) == [
        ("`NAME`", "required", "who"),
        ("`--model`", "required", "a model"),
        ("`--port`", "`7`", "port (default: 7)"),
        ("`--mode`", "`a`", "a | b (one of `a`, `b`)"),
        ("`--fast`", "off", "go fast"),
        ("`--limit`", "—", "limit"),
    ]
    # A pipe in help text must not split the markdown row.
    rows = _table(("flag", "default", "description"), flag_rows(parser))
    assert "| `--mode` | `a` | a \\| b (one of `a`, `b`) |" in rows


def test_every_environment_variable_the_settings_read_is_documented():
    """The code reads the environment only through `base.settings` (tests/test_settings.py checks it)."""
    block = render()
    for variable in Settings.variables():
        assert f"| `{variable.name}` | {variable.default} | {variable.meaning} |" in block


def test_check_and_write_rewrite_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    before, after = "# Title\n\nintro\n\n", "\n\n## Next\n\ntext\n"
    readme.write_text(f"{before}{START_MARKER}\nold table\n{END_MARKER}{after}")
    assert main(["--check", str(readme)]) == EXIT_STALE
    assert main(["--write", str(readme)]) == 0
    assert readme.read_text() == f"{before}{render()}{after}"
    assert main(["--check", str(readme)]) == 0
    readme.write_text("# no markers\n")
    assert main(["--check", str(readme)]) == EXIT_NO_MARKERS
    assert main(["--write", str(readme)]) == EXIT_NO_MARKERS
    assert readme.read_text() == "# no markers\n"


def test_readme_config_table_is_current(repo_root):
    readme = repo_root / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.exists() else ""
    if START_MARKER not in text or END_MARKER not in text:
        pytest.skip("README.md has no config-table markers yet (the lead adds them)")
    assert main(["--check", str(readme)]) == 0, "run: python -m tandem.config_docs --write README.md"
