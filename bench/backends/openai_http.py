"""Any OpenAI-compatible server (tandem's HTTP API, vLLM, llama-server, ...): `/v1/completions` over SSE.

The prompt goes as token ids, so every system sees exactly the workload's prompt length; temperature 0
is greedy, and `ignore_eos` (vLLM's extra, which llama-server and tandem also honour) with `max_tokens`
gives exact output lengths. An OpenAI stream chunk does not say how many tokens it carries: each chunk
with text counts as one, and the final usage settles any difference (tokens held back in an incomplete
UTF-8 character, or several tokens in one chunk).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from bench.backends.sse import get_json, post_sse
from bench.workload import WorkloadRequest


class OpenAIBackend:
    """Streams completions from an OpenAI-compatible HTTP server at `base_url`."""

    def __init__(self, base_url: str, name: str = "openai") -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.model: str | None = None

    async def open(self) -> dict:
        models = await get_json(f"{self.base_url}/v1/models")
        model = (models.get("data") or [{}])[0]
        self.model = model.get("id")
        return {"kind": "openai", "target": self.base_url, "model_name": self.model or ""}

    def payload(self, request: WorkloadRequest) -> dict[str, Any]:
        """The request body for one workload request; subclasses add their server's own fields."""
        return {
            "model": self.model,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def stream(self, request: WorkloadRequest, request_id: str) -> AsyncIterator[int]:
        counted = 0
        async for event in post_sse(f"{self.base_url}/v1/completions", self.payload(request)):
            choices = event.get("choices") or []
            if choices and choices[0].get("finish_reason") is None:
                counted += 1
                yield 1
            usage = event.get("usage")
            if usage and usage.get("completion_tokens", 0) > counted:
                yield usage["completion_tokens"] - counted
                counted = usage["completion_tokens"]

    async def close(self) -> None:
        """Nothing to release: every request has its own connection."""
