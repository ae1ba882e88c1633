"""The llama.cpp backend: `llama-server`'s OpenAI-compatible `/v1/completions`, streamed over SSE.

The prompt goes as token ids (llama.cpp accepts an array of ids), so it has exactly the length tandem
sees; `ignore_eos` with `max_tokens`/`n_predict` gives exact output lengths, temperature 0 is greedy and
prompt caching is off so a repeated prompt is not a free prefill. llama-server streams one event per
token; events whose text is held back (an incomplete UTF-8 character) still count, and the final usage
count settles any difference.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from bench.backends.sse import get_json, post_sse
from bench.workload import WorkloadRequest


class LlamaServerBackend:
    def __init__(self, base_url: str, name: str = "llama-server") -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")

    async def open(self) -> dict:
        models = await get_json(f"{self.base_url}/v1/models")
        model = (models.get("data") or [{}])[0]
        props = await get_json(f"{self.base_url}/props")
        return {
            "kind": "llama-server",
            "target": self.base_url,
            "model_name": model.get("id", ""),
            "vocab_size": (model.get("meta") or {}).get("n_vocab"),
            "total_slots": props.get("total_slots"),
            "build_info": props.get("build_info"),
        }

    async def stream(self, request: WorkloadRequest, request_id: str) -> AsyncIterator[int]:
        payload = {
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.output_len,
            "n_predict": request.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        counted = 0
        async for event in post_sse(f"{self.base_url}/v1/completions", payload):
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
