"""The llama.cpp backend: `llama-server` through the OpenAI backend, plus what llama.cpp needs to be fair.

`n_predict` backs up `max_tokens`, and prompt caching is off so a repeated prompt is not a free prefill;
`/props` tells the slot count and build for the result file.
"""

from __future__ import annotations

from typing import Any

from bench.backends.openai_http import OpenAIBackend
from bench.backends.sse import get_json
from bench.workload import WorkloadRequest


class LlamaServerBackend(OpenAIBackend):
    def __init__(self, base_url: str, name: str = "llama-server") -> None:
        super().__init__(base_url, name)

    async def open(self) -> dict:
        models = await get_json(f"{self.base_url}/v1/models")
        model = (models.get("data") or [{}])[0]
        self.model = model.get("id")
        props = await get_json(f"{self.base_url}/props")
        return {
            "kind": "llama-server",
            "target": self.base_url,
            "model_name": model.get("id", ""),
            "vocab_size": (model.get("meta") or {}).get("n_vocab"),
            "total_slots": props.get("total_slots"),
            "build_info": props.get("build_info"),
        }

    def payload(self, request: WorkloadRequest) -> dict[str, Any]:
        return {**super().payload(request), "n_predict": request.output_len, "cache_prompt": False}
