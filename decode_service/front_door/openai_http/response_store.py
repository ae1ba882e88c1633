"""Stored Responses API answers, for `previous_response_id` and `GET`/`DELETE /v1/responses/{id}`.

Held in this process's memory, bounded by bytes (the oldest go first when a new one would pass the
bound) and by age (an entry older than the TTL is gone), and keyed by tenant: a tenant that asks for
another tenant's id is told it does not exist, exactly as for an id never stored, so ids leak nothing.
A replica that restarts forgets them, and replicas behind one gateway do not share them (vLLM's store
is the same: in memory, per process).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from base.errors import ConfigError
from base.logs import log_event
from protos.tandem.v1 import generation_pb2 as pb

logger = logging.getLogger(__name__)

DEFAULT_STORE_BYTES = 64 * 2**20
DEFAULT_STORE_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    """A finished response and the conversation that led to it (its instructions excepted, which a
    continuation does not inherit), so that a continuation's prompt holds every earlier turn."""

    body: dict[str, Any]
    conversation: tuple[pb.ChatMessage, ...]
    size: int

    @classmethod
    def of(cls, body: dict[str, Any], conversation: list[pb.ChatMessage], body_bytes: int) -> StoredResponse:
        """`body_bytes`: the length of the body as JSON (what the client was sent)."""
        size = body_bytes + sum(message.ByteSize() for message in conversation)
        return cls(body, tuple(conversation), size)


@dataclass
class _Entry:
    tenant: str
    response: StoredResponse
    stored_at: float


class ResponseStore:
    """At most `max_bytes` of responses, each kept `ttl_s` seconds at most; `clock` is for tests."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes < 1:
            raise ConfigError(f"the responses store's byte bound must be >= 1, got {max_bytes}")
        if not ttl_s > 0:
            raise ConfigError(f"the responses store's TTL must be > 0 seconds, got {ttl_s}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        # Oldest first: eviction and expiry both take from the front.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, response_id: str, response: StoredResponse) -> bool:
        """Store `response` for `tenant`, evicting the oldest entries it needs room from; False (nothing
        stored, nothing evicted) when it alone is larger than the whole bound."""
        if response.size > self.max_bytes:
            log_event(logger, logging.WARNING, "response not stored: larger than the store",
                      response_id=response_id, bytes=response.size, max_bytes=self.max_bytes)  # fmt: skip
            return False
        self._expire()
        self._remove(response_id)
        while self.bytes + response.size > self.max_bytes:
            evicted, entry = self._entries.popitem(last=False)
            self.bytes -= entry.response.size
            log_event(logger, logging.INFO, "stored response evicted", response_id=evicted,
                      tenant=entry.tenant or "-", bytes=entry.response.size)  # fmt: skip
        self._entries[response_id] = _Entry(tenant, response, self._clock())
        self.bytes += response.size
        return True

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The response stored under `response_id` by `tenant`; None when absent, expired or another's."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            return None
        return entry.response

    def delete(self, tenant: str, response_id: str) -> bool:
        """Remove `tenant`'s response `response_id`; False when it has none by that id."""
        if self.get(tenant, response_id) is None:
            return False
        self._remove(response_id)
        return True

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.response.size

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        while self._entries:
            response_id, entry = next(iter(self._entries.items()))
            if entry.stored_at > deadline:
                return
            self._remove(response_id)
