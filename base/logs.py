"""Structured logging shared by both tiers and `tandem up`: one event per line, as text or JSON.

Why one module: both tiers log the same kind of events (a request accepted, finished, refused) and
operators parse them with the same pipeline, so the JSON shape, the request-id rule and the prompt
rule must not drift between tiers.

- `log_event(logger, level, "request finished", request_id=..., ...)` writes the fields into the
  message (`request finished request_id=abc prompt_tokens=12`) for people who grep, and as record
  attributes, which `--log-format json` turns into keys.
- `bind_request_id(request_id)` tags every later line of the current asyncio task (one gRPC call)
  with that request id, so even a plain `logger.error(...)` deep in a handler says which request.
- Prompts and generated text are user data: they are logged only after `set_log_prompts(True)`
  (`--log-prompts`), through `prompt_fields(...)`, never by default.
"""

from __future__ import annotations

import contextvars
import json
import logging
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from `extra=` or a filter.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("tandem_request_id", default=None)
_log_prompts = False


def set_log_prompts(enabled: bool) -> None:
    """Allow (or forbid again) prompt and completion text in log lines; off unless `--log-prompts`."""
    global _log_prompts
    _log_prompts = enabled


def log_prompts_enabled() -> bool:
    return _log_prompts


def prompt_fields(**fields: Any) -> dict[str, Any]:
    """`fields` (prompt text, token ids, completion text) when prompt logging is on, else nothing.

    Callers spread the result into `log_event`, so the decision lives here and not at every call site.
    """
    return dict(fields) if _log_prompts else {}


def bind_request_id(request_id: str) -> None:
    """Tag the log lines of the current context (an asyncio task: one gRPC call) with `request_id`."""
    _request_id.set(request_id)


class RequestIdFilter(logging.Filter):
    """Copies the context's request id onto records that do not carry one already."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = _request_id.get()
        if request_id is not None and not hasattr(record, "request_id"):
            record.request_id = request_id
        return True


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    """Log `event` with its fields in the message (text) and as record attributes (JSON)."""
    if not logger.isEnabledFor(level):
        return
    shown = " ".join(f"{key}={_format(value)}" for key, value in fields.items())
    logger.log(level, "%s %s", event, shown, extra={"event": event, **fields}, stacklevel=2)


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, str) and (
        not value or not value.isprintable() or any(c.isspace() or c in '"=' for c in value)
    ):
        # Quoted so that `key=value` pairs stay splittable when a value has spaces (prompts, reasons);
        # escaped so that a client's newline or control character can never forge a line of its own.
        return json.dumps(value, ensure_ascii=not value.isprintable())
    return str(value)


class TextFormatter(logging.Formatter):
    """The human format; a request id bound to the context is appended when the message lacks it."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None)
        if request_id is not None and f"request_id={_format(request_id)}" not in line:
            line += f" request_id={_format(request_id)}"
        return line


class JsonFormatter(logging.Formatter):
    """Formats a record as {"time", "level", "logger", "message", ...extra fields, "exc_info"?}."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(
            (key, value)
            for key, value in vars(record).items()
            if key not in _STANDARD_ATTRS and not key.startswith("_")
        )
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def use_log_format(log_format: str) -> None:
    """Give the root logger's handlers the `text` or `json` formatter and the request-id filter."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, not {log_format!r}")
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
        if not any(isinstance(f, RequestIdFilter) for f in handler.filters):
            handler.addFilter(RequestIdFilter())
