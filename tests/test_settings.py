"""`base.settings`: the defaults, each variable parsed into its type, bad values refused by name, the
environment read at call time, and no product code reading the environment any other way."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from base import settings as s
from base.errors import ConfigError
from base.settings import Settings, SettingsError, get_settings

PRODUCT_PACKAGES = (
    "base",
    "engine",
    "kernels",
    "kv_transfer",
    "serving",
    "decode_service",
    "prefill_service",
    "tandem",
)


def test_defaults(monkeypatch):
    monkeypatch.setenv("HOME", "/home/someone")
    defaults = Settings()
    assert defaults == Settings.from_env({})
    assert defaults.home == Path("/home/someone/.cache/tandem")
    assert defaults.auth_token is None
    assert defaults.target == "localhost:50051"
    assert defaults.attention_backend == "auto"
    assert defaults.cpu_extension and defaults.onednn_linear and defaults.cpu_decode_stack
    assert defaults.parent_pid is None


@pytest.mark.parametrize(
    ("name", "raw", "field", "expected"),
    [
        (s.HOME_ENV, "/srv/tandem", "home", Path("/srv/tandem")),
        (s.HOME_ENV, "~/t", "home", Path.home() / "t"),
        (s.AUTH_TOKEN_ENV, " secret\n", "auth_token", "secret"),
        (s.AUTH_TOKEN_ENV, "  ", "auth_token", None),
        (s.TARGET_ENV, "dns:///decode:50051", "target", "dns:///decode:50051"),
        (s.ATTENTION_BACKEND_ENV, "Triton", "attention_backend", "triton"),
        (s.ATTENTION_BACKEND_ENV, "torch", "attention_backend", "torch"),
        (s.CPU_EXTENSION_ENV, "0", "cpu_extension", False),
        (s.CPU_EXTENSION_ENV, "1", "cpu_extension", True),
        (s.ONEDNN_LINEAR_ENV, "0", "onednn_linear", False),
        (s.CPU_DECODE_STACK_ENV, "0", "cpu_decode_stack", False),
        (s.PARENT_PID_ENV, "4242", "parent_pid", 4242),
    ],
)
def test_each_variable_is_parsed_into_its_field(name, raw, field, expected):
    parsed = Settings.from_env({name: raw})
    assert getattr(parsed, field) == expected
    others = {f: v for f, v in vars(parsed).items() if f != field}
    assert others == {f: v for f, v in vars(Settings()).items() if f != field}


def test_an_empty_variable_counts_as_unset():
    assert Settings.from_env({v.name: "" for v in Settings.variables()}) == Settings()


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        (s.ATTENTION_BACKEND_ENV, "cuda", "must be auto, torch or triton, not 'cuda'"),
        (s.CPU_EXTENSION_ENV, "false", "must be 0 \\(off\\) or 1 \\(on\\), not 'false'"),
        (s.ONEDNN_LINEAR_ENV, "2", "must be 0 \\(off\\) or 1 \\(on\\)"),
        (s.CPU_DECODE_STACK_ENV, "yes", "must be 0 \\(off\\) or 1 \\(on\\)"),
        (s.PARENT_PID_ENV, "abc", "must be a process id"),
        (s.PARENT_PID_ENV, "-3", "must be a process id"),
        (s.PARENT_PID_ENV, "0", "must be a process id"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(name, raw, message):
    with pytest.raises(SettingsError, match=f"^{name} {message}"):
        Settings.from_env({name: raw})


def test_a_bad_value_is_a_config_error():
    assert issubclass(SettingsError, ConfigError) and issubclass(SettingsError, ValueError)


def test_get_settings_reads_the_environment_at_call_time(monkeypatch):
    monkeypatch.setenv(s.CPU_DECODE_STACK_ENV, "0")
    assert get_settings().cpu_decode_stack is False
    monkeypatch.delenv(s.CPU_DECODE_STACK_ENV)
    assert get_settings().cpu_decode_stack is True


def test_every_field_has_one_variable_of_its_own():
    names = [v.name for v in Settings.variables()]
    assert len(names) == len(set(names)) == len(vars(Settings()))
    # tandem's own, and OpenTelemetry's standard variable, honoured as its SDK honours it.
    assert all(name.startswith(("TANDEM_", "OTEL_")) for name in names)


def _environment_reads(tree: ast.AST) -> list[int]:
    """Lines that read a variable: `os.environ.get(...)`, `os.getenv(...)`, `os.environ[...]` (not an
    assignment) and `... in os.environ`. Passing the environment on (`{**os.environ}`) is not a read."""

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if (func.attr == "get" and is_environ(func.value)) or func.attr == "getenv":
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and is_environ(node.value) and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            lines.append(node.lineno)
    return lines


def test_no_product_code_reads_the_environment_but_the_settings(repo_root):
    offenders = []
    for package in PRODUCT_PACKAGES:
        for path in sorted((repo_root / package).rglob("*.py")):
            if path == repo_root / "base" / "settings.py" or "_pb2" in path.name:
                continue
            for line in _environment_reads(ast.parse(path.read_text(encoding="utf-8"))):
                offenders.append(f"{path.relative_to(repo_root)}:{line}")
    assert not offenders, f"read the environment through base.settings instead: {offenders}"


def test_the_cli_names_a_bad_variable_in_one_line_instead_of_a_traceback(monkeypatch, capsys):
    from tandem.cli import main

    monkeypatch.setenv(s.CPU_EXTENSION_ENV, "false")
    assert main(["serve", "decode", "--help"]) == 2
    expected = f"tandem: {s.CPU_EXTENSION_ENV} must be 0 (off) or 1 (on), not 'false'\n"
    assert capsys.readouterr().err == expected
