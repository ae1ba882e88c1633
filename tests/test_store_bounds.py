"""Stores the front door keeps across requests hold at most what their bounds say, in resident bytes.

Each test fills a store well past its entry bound with the largest entries validation admits, and reads
the process's RSS growth (not the store's own count): what the README's memory table states.
"""

from __future__ import annotations

import gc
import random

import pytest

from decode_service.engine_core.resident_memory import release_free_memory, resident_bytes
from decode_service.front_door.admission import RequestLimits
from decode_service.front_door.choice_text import StopStringMatcher, stop_automaton

MIB = 2**20
# The README's figure for the shared stop-string automata at the validation limits.
STOP_AUTOMATA_BOUND = 96 * MIB

pytestmark = pytest.mark.skipif(resident_bytes() is None, reason="reads /proc/self/status")


def _settled_rss() -> int:
    gc.collect()
    release_free_memory()
    rss = resident_bytes()
    assert rss is not None
    return rss


def test_shared_stop_automata_stay_within_their_bound():
    """Every request with a distinct stop set, each of the most and longest stop strings admitted: the
    automata shared between requests stay at 64, within the bound, however many sets arrive."""
    limits = RequestLimits()
    rng = random.Random(0)
    stop_automaton.cache_clear()
    before = _settled_rss()
    for _ in range(3 * stop_automaton.cache_info().maxsize):
        stop = [
            "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(limits.max_stop_string_length))
            for _ in range(limits.max_stop_strings)
        ]
        StopStringMatcher(stop)
    grown = _settled_rss() - before
    assert stop_automaton.cache_info().currsize == stop_automaton.cache_info().maxsize == 64
    assert grown <= STOP_AUTOMATA_BOUND, f"{grown / MIB:.0f} MiB"
    stop_automaton.cache_clear()
