"""Every environment variable tandem reads, parsed into one typed, frozen `Settings`.

Flags configure one server; these variables reach what a flag cannot or should not have to: where
tandem keeps its files, the token the tiers and the client share, kernel switches for a whole machine
(read by `kernels.platform`), and what `tandem up` tells the tiers it starts. Each field of `Settings`
carries its `Variable` (name, default, meaning, parser), which the README's table is generated from
(`tandem.config_docs`), so the documentation and the parsing cannot drift apart.

An unset or empty variable takes its default; a value that cannot be parsed is refused by a
`SettingsError` that names the variable, rather than being read as some default. `get_settings()`
parses the environment on every call and caches nothing, so a variable set after import (a test's
monkeypatch, a launcher's edit) is seen by the next reader; no reader is on a per-token path.

Setting variables for a child process (`tandem up`) is not reading them: that code uses the names
defined here and passes its environment on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from base.errors import ConfigError

HOME_ENV = "TANDEM_HOME"
AUTH_TOKEN_ENV = "TANDEM_AUTH_TOKEN"
TARGET_ENV = "TANDEM_TARGET"
ATTENTION_BACKEND_ENV = "TANDEM_ATTENTION_BACKEND"
CPU_EXTENSION_ENV = "TANDEM_CPU_EXTENSION"
ONEDNN_LINEAR_ENV = "TANDEM_ONEDNN_LINEAR"
CPU_DECODE_STACK_ENV = "TANDEM_CPU_DECODE_STACK"
PARENT_PID_ENV = "TANDEM_PARENT_PID"
# OpenTelemetry's own variable, read as its SDK reads it, so one setting reaches every OTLP-aware process.
OTLP_TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"

ATTENTION_BACKENDS = ("auto", "torch", "triton")
DEFAULT_TARGET = "localhost:50051"


class SettingsError(ConfigError):
    """An environment variable holds a value tandem cannot use; the message names the variable (a
    ConfigError, so the CLI reports it as one line)."""


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, its default as the README shows it, what it does, and its
    parser (which raises ValueError saying what it expected)."""

    name: str
    default: str
    meaning: str
    parse: Callable[[str], Any]

    def read(self, raw: str) -> Any:
        """`raw` parsed, or a SettingsError naming this variable and the value refused."""
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise SettingsError(f"{self.name} {exc}, not {raw!r}") from None


def _path(raw: str) -> Path:
    return Path(raw).expanduser()


def _text(raw: str) -> str:
    return raw


def _optional_text(raw: str) -> str | None:
    return raw.strip() or None


def _token(raw: str) -> str | None:
    # Surrounding whitespace goes: a token copied from a mounted secret usually ends with a newline.
    return raw.strip() or None


def _attention_backend(raw: str) -> str:
    choice = raw.strip().lower()
    if choice not in ATTENTION_BACKENDS:
        raise ValueError("must be auto, torch or triton")
    return choice


def _switch(raw: str) -> bool:
    value = raw.strip()
    if value not in ("0", "1"):
        raise ValueError("must be 0 (off) or 1 (on)")
    return value == "1"


def _pid(raw: str) -> int:
    text = raw.strip()
    if not (text.isascii() and text.isdigit()) or int(text) == 0:
        raise ValueError("must be a process id (a positive integer)")
    return int(text)


def _default_home() -> Path:
    return Path.home() / ".cache" / "tandem"


def _read_from(variable: Variable, **value: Any) -> Any:
    """A `Settings` field read from `variable`; `value` is its dataclass default (`default=` or
    `default_factory=`), which an unset variable leaves in place."""
    return field(metadata={"variable": variable}, **value)


@dataclass(frozen=True)
class Settings:
    """The environment switches, typed; `Settings()` is every default. Each field's `Variable` is in
    its metadata (`variables()`)."""

    home: Path = _read_from(
        Variable(
            HOME_ENV,
            "`~/.cache/tandem`",
            "where `tandem fetch-model` caches models and the tiers find the default model",
            _path,
        ),
        default_factory=_default_home,
    )
    auth_token: str | None = _read_from(
        Variable(
            AUTH_TOKEN_ENV,
            "unset (no auth)",
            "bearer token the servers require (when no `--auth-token-file`) and `tandem generate` sends "
            "(when no `--auth-token`)",
            _token,
        ),
        default=None,
    )
    target: str = _read_from(
        Variable(
            TARGET_ENV,
            f"`{DEFAULT_TARGET}`",
            "the decode server `tandem generate` calls when no `--target` is given",
            _text,
        ),
        default=DEFAULT_TARGET,
    )
    attention_backend: str = _read_from(
        Variable(
            ATTENTION_BACKEND_ENV,
            "`auto`",
            "attention kernels: `auto` (Triton on CUDA, torch elsewhere), `torch` or `triton`",
            _attention_backend,
        ),
        default="auto",
    )
    cpu_extension: bool = _read_from(
        Variable(
            CPU_EXTENSION_ENV,
            "`1`",
            "`0` skips the C++ CPU kernels (paged attention, fused norm/RoPE/SiLU), built with the machine's "
            "compiler on first use, and runs the torch reference instead",
            _switch,
        ),
        default=True,
    )
    onednn_linear: bool = _read_from(
        Variable(
            ONEDNN_LINEAR_ENV,
            "`1`",
            "`0` keeps fp32 CPU linear layers on `nn.Linear` (MKL) instead of tandem's GEMV (up to 16 rows) "
            "and oneDNN with weights converted once (more rows), and the LM head off its greedy path that "
            "never writes the logits",
            _switch,
        ),
        default=True,
    )
    cpu_decode_stack: bool = _read_from(
        Variable(
            CPU_DECODE_STACK_ENV,
            "`1`",
            "`0` runs decode-only fp32 CPU steps layer by layer from Python, not all layers in one C++ call "
            "(same numbers; the C++ call saves the per-layer Python and op overhead)",
            _switch,
        ),
        default=True,
    )
    otlp_traces_endpoint: str | None = _read_from(
        Variable(
            OTLP_TRACES_ENDPOINT_ENV,
            "unset (tracing off)",
            "the OTLP gRPC collector the tiers export traces to when no `--otlp-traces-endpoint` is given "
            "(http://host:port or https://host:port); the other `OTEL_*` variables are the SDK's own",
            _optional_text,
        ),
        default=None,
    )
    parent_pid: int | None = _read_from(
        Variable(
            PARENT_PID_ENV,
            "unset",
            "set by `tandem up` on the tiers it starts (its own process id): a tier stops when that process "
            "dies; not for users",
            _pid,
        ),
        default=None,
    )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Parse `environ` (default: this process's environment); raises SettingsError on a bad value."""
        environ = os.environ if environ is None else environ
        values = {}
        for spec in fields(cls):
            variable = spec.metadata["variable"]
            raw = environ.get(variable.name, "")
            if raw:
                values[spec.name] = variable.read(raw)
        return cls(**values)

    @classmethod
    def variables(cls) -> tuple[Variable, ...]:
        """Every variable, in field order (the order the README lists them in)."""
        return tuple(spec.metadata["variable"] for spec in fields(cls))


def get_settings() -> Settings:
    """The settings of the environment as it is now (parsed on every call; see the module docstring)."""
    return Settings.from_env()
