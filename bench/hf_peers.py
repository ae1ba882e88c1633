"""The Hugging Face `transformers` peers, run in-process on the same requests as the servers.

- Static batching (the baseline): `generate` on batches of B requests in arrival order, prompts left
  padded, EOS off, each batch running until its longest member is done. Only each request's own
  tokens are counted (the steps a finished member keeps riding along produce nothing useful). Token
  times come from a streamer called after every step, as if a server streamed them; that favours
  HF: a plain `generate` caller sees nothing before the whole batch is done.
- Continuous batching: the `ContinuousBatchingManager` of recent `transformers` (`generate_batch`'s
  engine), every request added at once with its own `max_new_tokens`, per-token timestamps
  recorded by the manager. We record which attention implementation it ran.

Both return the same `RequestRecord`s as the load generator, so one metrics function serves all.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from bench.metrics import RequestRecord
from bench.workload import WorkloadRequest

logger = logging.getLogger(__name__)

CB_RESULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class PeerRun:
    records: list[RequestRecord]
    duration_s: float
    info: dict


def load_hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class StepClock(BaseStreamer):
    """Records when each decoding step's tokens exist; `generate` calls `put` once with the prompt first."""

    def __init__(self) -> None:
        self.step_times: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._seen_prompt:
            self.step_times.append(time.perf_counter())
        self._seen_prompt = True

    def end(self) -> None:
        """Nothing to flush: only the times matter."""


def _greedy_config(max_new_tokens: int, pad_token_id: int) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )


def _left_padded(requests: Sequence[WorkloadRequest], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.prompt_len for r in requests)
    ids = torch.full((len(requests), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(requests), width), dtype=torch.long)
    for row, request in enumerate(requests):
        ids[row, width - request.prompt_len :] = torch.tensor(request.prompt_token_ids)
        mask[row, width - request.prompt_len :] = 1
    return ids, mask


def _static_batch(model: torch.nn.Module, batch: Sequence[WorkloadRequest], pad_token_id: int) -> list[float]:
    ids, mask = _left_padded(batch, pad_token_id)
    clock = StepClock()
    new_tokens = max(r.output_len for r in batch)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            generation_config=_greedy_config(new_tokens, pad_token_id),
            streamer=clock,
        )
    if out.shape[1] - ids.shape[1] != new_tokens or len(clock.step_times) != new_tokens:
        raise RuntimeError(f"HF generate made {out.shape[1] - ids.shape[1]} tokens, expected {new_tokens}")
    return clock.step_times


def run_hf_static(
    model: torch.nn.Module, requests: Sequence[WorkloadRequest], batch_size: int, pad_token_id: int
) -> PeerRun:
    """All requests arrive at t=0 and are served in batches of `batch_size`, one batch after another."""
    warm = WorkloadRequest(-1, requests[0].prompt_token_ids[:8], 2)
    _static_batch(model, [warm], pad_token_id)
    start = time.perf_counter()
    records = []
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        step_times = _static_batch(model, batch, pad_token_id)
        for request in batch:
            record = RequestRecord(request.index, request.prompt_len, request.output_len, start)
            for at in step_times[: request.output_len]:
                record.add_chunk(at, 1)
            record.end_time = step_times[request.output_len - 1]
            records.append(record)
    duration = time.perf_counter() - start
    info = {
        "kind": "hf-static",
        "batch_size": batch_size,
        "attn_implementation": model.config._attn_implementation,
    }
    return PeerRun(records, duration, info)


def continuous_batching_available(model: torch.nn.Module) -> bool:
    return hasattr(model, "continuous_batching_context_manager")


def run_hf_continuous(
    model: torch.nn.Module,
    requests: Sequence[WorkloadRequest],
    max_requests_per_batch: int,
    max_batch_tokens: int,
    page_size: int = 256,
) -> PeerRun:
    """All requests are added at t=0 to transformers' continuous-batching manager."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    blocks = sum(math.ceil((r.prompt_len + r.output_len) / page_size) for r in requests) + len(requests)
    config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=blocks,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests_per_batch,
    )
    generation = _greedy_config(max(r.output_len for r in requests), pad_token_id=0)
    with model.continuous_batching_context_manager(
        generation_config=generation,
        continuous_batching_config=config,
        block=True,
        timeout=CB_RESULT_TIMEOUT_S,
    ) as manager:
        attn_implementation = model.config._attn_implementation
        manager.add_request(list(requests[0].prompt_token_ids[:8]), request_id="hf-warmup", max_new_tokens=2)
        if manager.get_result(request_id="hf-warmup", timeout=CB_RESULT_TIMEOUT_S) is None:
            raise RuntimeError("HF continuous batching did not answer its warm-up request")
        start = time.perf_counter()
        by_id = {
            manager.add_request(
                list(r.prompt_token_ids),
                request_id=f"hf-{r.index}",
                max_new_tokens=r.output_len,
                record_timestamps=True,
            ): r
            for r in requests
        }
        results = {}
        while len(results) < len(by_id):
            result = manager.get_result(timeout=CB_RESULT_TIMEOUT_S)
            if result is None:
                left = len(by_id) - len(results)
                raise RuntimeError(f"HF continuous batching stalled with {left} requests left")
            if result.is_finished():
                results[result.request_id] = result
        duration = max(r.timestamps[-1] for r in results.values() if r.timestamps) - start
    records = []
    for request_id, request in by_id.items():
        result = results[request_id]
        record = RequestRecord(request.index, request.prompt_len, request.output_len, start)
        for at in result.timestamps or []:
            record.add_chunk(at, 1)
        record.end_time = record.chunk_times[-1] if record.chunk_times else time.perf_counter()
        record.error = result.error
        records.append(record)
    records.sort(key=lambda r: r.index)
    info = {
        "kind": "hf-continuous",
        "attn_implementation": attn_implementation,
        "page_size": page_size,
        "num_blocks": blocks,
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests_per_batch,
    }
    return PeerRun(records, duration, info)
