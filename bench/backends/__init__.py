"""Streaming clients of the systems under test, behind one small interface the load generator drives.

A backend turns one `WorkloadRequest` into a stream of token counts: one value per stream message that
carried tokens, yielded the moment the message arrives, so the runner can timestamp it. Every backend
asks for greedy decoding of exactly `output_len` tokens with end-of-sequence ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from bench.workload import WorkloadRequest


class StreamingBackend(Protocol):
    """A system under test reached over the network (gRPC or HTTP)."""

    name: str

    async def open(self) -> dict:
        """Connect and return what the server says about itself (model, mode...) for the result file."""
        ...

    def stream(self, request: WorkloadRequest, request_id: str) -> AsyncIterator[int]:
        """Send one request; yield the number of new tokens of each stream message as it arrives."""
        ...

    async def close(self) -> None: ...
