"""The decode tier's log formats: `tandem.logs`, shared with the prefill tier so both emit one JSON shape."""

from tandem.logs import JsonFormatter, log_event, use_log_format

__all__ = ["JsonFormatter", "log_event", "use_log_format"]
