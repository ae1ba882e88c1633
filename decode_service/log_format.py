"""`--log-format json`: one JSON object per log line, for log pipelines that parse rather than grep."""

from __future__ import annotations

import json
import logging

# Attributes every LogRecord has; anything else on a record came from `extra=` and is worth keeping.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """Formats a record as {"time", "level", "logger", "message", ...extra fields, "exc_info"?}."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def use_log_format(log_format: str) -> None:
    """Switch the root logger's handlers to `text` (leave as configured) or `json`."""
    if log_format == "json":
        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
