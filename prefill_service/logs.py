"""The prefill tier's structured log lines: `tandem.logs`, shared with the decode tier so both emit one
JSON shape. Prompt text never appears unless `--log-prompts`: only ids and counts."""

from tandem.logs import JsonFormatter, log_event, use_log_format

__all__ = ["JsonFormatter", "log_event", "use_log_format"]
