"""Structured log lines: one per event that matters, readable as text and parseable as JSON.

`event_fields` builds both at once: the message reads `prefill finished request_id=... queue_s=...`
for people who grep, and the same fields ride along as `extra` so `--log-format json` emits them as
keys. Prompt text never appears: only ids and counts.
"""

from __future__ import annotations

import json
import logging
from typing import Any

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def log_event(logger: logging.Logger, level: int, event: str, **fields: Any) -> None:
    """Log `event` with its fields in the message (text) and as record attributes (JSON)."""
    if not logger.isEnabledFor(level):
        return
    shown = " ".join(f"{key}={_format(value)}" for key, value in fields.items())
    logger.log(level, "%s %s", event, shown, extra={"event": event, **fields}, stacklevel=2)


def _format(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


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
    """Switch the root logger's handlers to `json`; `text` leaves them as configured."""
    if log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
