"""Progress of a long load or copy (a checkpoint streaming into the model, a model being fetched): items
and bytes done, the rate and the time left.

An 8 B checkpoint takes minutes to load on a small CPU machine, and a server that says nothing for that
long looks hung (issue 55). On a terminal the progress is one line on stderr, redrawn in place a few times
a second; anywhere else (a log file, a container's log, `tandem up`'s tiers, whose stderr is a pipe) it is
a structured log line every `LOG_INTERVAL_S`. A load done within `QUIET_S` shows nothing: the common case
(a small model) keeps its start-up output as it was. The clock and the stream are injectable, so what is
shown when is a function of the calls alone (tests/test_load_plan.py).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO, TypeVar

from base.logs import log_event

logger = logging.getLogger(__name__)

# Nothing is shown for a load that ends within this many seconds.
QUIET_S = 2.0
# Seconds between log lines where stderr is not a terminal, and between redraws where it is.
LOG_INTERVAL_S = 5.0
REDRAW_INTERVAL_S = 0.25
MIB = 1 << 20

T = TypeVar("T")


class LoadProgress:
    """Counts what a load has done against its total and shows it as the module says."""

    def __init__(
        self,
        what: str,
        total_items: int,
        total_bytes: int,
        unit: str = "tensors",
        clock: Callable[[], float] = time.monotonic,
        stream: TextIO | None = None,
        tty: bool | None = None,
    ) -> None:
        """`what` names the load in each line ("loading SmolLM2-135M-Instruct"); `unit` its items.
        `stream` defaults to stderr, and `tty` to whether that stream is a terminal."""
        self.what, self.unit = what, unit
        self.total_items, self.total_bytes = total_items, total_bytes
        self.items = self.bytes = 0
        self._clock = clock
        self._stream = sys.stderr if stream is None else stream
        self._tty = self._stream.isatty() if tty is None else tty
        self._started = clock()
        self._last_shown: float | None = None
        self._drawn = False

    def advance(self, items: int = 1, nbytes: int = 0) -> None:
        """Count `items` and `nbytes` more done; show the progress if it is time to."""
        self.items += items
        self.bytes += nbytes
        now = self._clock()
        if self._due(now):
            self._last_shown = now
            self._show(now)

    def finish(self, event: str | None = None, **fields: object) -> float:
        """End the load, completing and closing a terminal line if one was drawn; with `event`, log the
        load's summary line under that name (items, bytes, seconds, rate and `fields`). Returns the
        seconds it took."""
        now = self._clock()
        if self._drawn:
            self._stream.write(f"\r\033[K{self.line(now)}\n")
            self._stream.flush()
        seconds = now - self._started
        if event is not None:
            log_event(
                logger,
                logging.INFO,
                event,
                **fields,
                **{self.unit: self.items},
                bytes=self.bytes,
                seconds=round(seconds, 2),
                mib_per_s=round(self.bytes / MIB / max(seconds, 1e-9), 1),
            )
        return seconds

    def line(self, now: float) -> str:
        """The progress as text: `what: 120/291 tensors, 5.1/14.8 GiB, 95 MiB/s, 1 min 44 s left`."""
        rate = self.bytes / max(now - self._started, 1e-9)
        return (
            f"{self.what}: {self.items}/{self.total_items} {self.unit}, "
            f"{_sizes(self.bytes, self.total_bytes)}, "
            f"{rate / MIB:.0f} MiB/s, {_duration(self._seconds_left(now))} left"
        )

    def _due(self, now: float) -> bool:
        if now - self._started < QUIET_S:
            return False
        if self._tty:
            return self._last_shown is None or now - self._last_shown >= REDRAW_INTERVAL_S
        last = self._started if self._last_shown is None else self._last_shown
        return now - last >= LOG_INTERVAL_S

    def _show(self, now: float) -> None:
        if self._tty:
            self._stream.write(f"\r\033[K{self.line(now)}")
            self._stream.flush()
            self._drawn = True
        else:
            self._log(now)

    def _log(self, now: float) -> None:
        elapsed = now - self._started
        log_event(
            logger,
            logging.INFO,
            "load progress",
            what=self.what,
            **{self.unit: self.items, f"total_{self.unit}": self.total_items},
            mib=round(self.bytes / MIB, 1),
            total_mib=round(self.total_bytes / MIB, 1),
            mib_per_s=round(self.bytes / MIB / max(elapsed, 1e-9), 1),
            seconds=round(elapsed, 1),
            seconds_left=round(self._seconds_left(now), 1),
        )

    def _seconds_left(self, now: float) -> float:
        rate = self.bytes / max(now - self._started, 1e-9)
        return (self.total_bytes - self.bytes) / rate if rate > 0 else 0.0


def track(items: Iterable[T], progress: LoadProgress, nbytes: Callable[[T], int]) -> Iterator[T]:
    """`items` as they come, each counted (`nbytes(item)` bytes) once the consumer asks for the next, so
    the time it spent on one (converting a tensor into its parameter) counts as part of the load."""
    for item in items:
        yield item
        progress.advance(1, nbytes(item))
    progress.finish()


def _sizes(done: int, total: int) -> str:
    """`done/total` in GiB when the total is a GiB or more, else in MiB."""
    if total >= 1 << 30:
        return f"{done / (1 << 30):.1f}/{total / (1 << 30):.1f} GiB"
    return f"{done / MIB:.0f}/{total / MIB:.0f} MiB"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"
