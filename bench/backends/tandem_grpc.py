"""The tandem backend: the public Generation API over gRPC through the asyncio client."""

from __future__ import annotations

from collections.abc import AsyncIterator

from bench.workload import WorkloadRequest
from tandem.client import AsyncTandemClient


class TandemBackend:
    """Streams requests to one tandem decode server; one HTTP/2 channel carries every request."""

    def __init__(
        self,
        target: str,
        name: str = "tandem",
        timeout_s: float | None = None,
        disable_speculation: bool = False,
    ) -> None:
        """`disable_speculation`: every request opts out of the server's speculative decoding."""
        self.name = name
        self._disable_speculation = disable_speculation
        self.target = target
        self._timeout_s = timeout_s
        self._client: AsyncTandemClient | None = None

    async def open(self) -> dict:
        # The channel belongs to the running loop, so it is created here rather than in __init__.
        self._client = AsyncTandemClient(self.target, timeout=self._timeout_s)
        info = await self._client.model_info()
        return {
            "kind": "tandem",
            "target": self.target,
            "model_name": info.model_name,
            "vocab_size": info.vocab_size,
            "dtype": info.dtype,
            "mode": info.mode.value,
            "server_version": info.server_version,
        }

    async def stream(self, request: WorkloadRequest, request_id: str) -> AsyncIterator[int]:
        assert self._client is not None, "open() first"
        async for delta in self._client.generate(
            token_ids=request.prompt_token_ids,
            temperature=0.0,
            max_tokens=request.output_len,
            ignore_eos=True,
            request_id=request_id,
            disable_speculation=self._disable_speculation,
        ):
            if delta.token_ids:
                yield len(delta.token_ids)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
