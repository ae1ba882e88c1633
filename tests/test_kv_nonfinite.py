"""NaN and infinity from a prefill tier never reach the decode tier's cache (issue 33, defect 7).

A chunk's CRC32C only proves its bytes are the sender's; a sender with broken numerics (or a rogue one)
sends NaN values or NaN scales with a valid checksum. The receiver refuses such a chunk before writing
anything, the attempt fails like one with a bad checksum, and the request is retried or prefilled
locally: the reply is the reference's, and the prefix cache holds no poisoned block.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import save_tiny_model, wait_until
from test_disagg_serving import RunningDecode, RunningPrefill, StepGate, prompts_of, tokens_of

from decode_service.engine_core.remote_prefill.transfer import KVTransfer
from decode_service.engine_core.request import ServedRequest
from engine.params import SamplingParams, StoppingParams
from engine.sequence import Sequence
from kernels import torch_reference as ref
from kv_transfer import KVLayout, KVNonFiniteError, PagedKV, parse_response, serialize_response
from kv_transfer.finite import count_non_finite
from protos.tandem.internal.v1 import prefill_pb2

NAN, INF = float("nan"), float("inf")


def _caches(layout: KVLayout, num_blocks: int, seed: int) -> dict[str, list[torch.Tensor]]:
    """K and V (and a quantized layout's scales) of random rows, stored as the cache write stores them."""
    gen = torch.Generator().manual_seed(seed)
    parts: dict[str, list[torch.Tensor]] = {"k": [], "v": [], "k_scales": [], "v_scales": []}
    for _ in range(layout.num_layers):
        for name in ("k", "v"):
            rows = torch.randn(num_blocks, *layout.block_shape, generator=gen)
            if layout.quantized:
                stored, scales = ref.quantize_kv(rows, layout.dtype)
                parts[name].append(stored)
                parts[f"{name}_scales"].append(scales)
            else:
                parts[name].append(rows.to(layout.dtype))
    if not layout.quantized:
        del parts["k_scales"], parts["v_scales"]
    return parts


def _paged(layout: KVLayout, caches: dict[str, list[torch.Tensor]]) -> PagedKV:
    return PagedKV(caches["k"], caches["v"], layout, caches.get("k_scales"), caches.get("v_scales"))


def _bytes(caches: dict[str, list[torch.Tensor]]) -> list[bytes]:
    return [t.view(torch.uint8).numpy().tobytes() for tensors in caches.values() for t in tensors]


@pytest.mark.parametrize(
    ("dtype", "poisoned", "value"),
    [
        (torch.float32, "v", NAN),
        (torch.float32, "k", INF),
        (torch.float16, "k", -INF),
        (torch.bfloat16, "v", NAN),
        (torch.float8_e4m3fn, "k", NAN),
        (torch.int8, "k_scales", NAN),
        (torch.int8, "v_scales", INF),
        (torch.float8_e4m3fn, "k_scales", -INF),
    ],
)
def test_a_chunk_with_a_non_finite_value_or_scale_is_refused_before_any_write(dtype, poisoned, value):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=dtype)
    sender = _caches(layout, 3, seed=1)
    sender[poisoned][1][2, 1, 0] = value  # layer 1, block 2, slot 1, head 0: a token the request holds
    (frame,) = _paged(layout, sender).frames([0, 1, 2], 0, 3, num_tokens=10)  # a valid CRC32C
    received = parse_response(serialize_response(frame))
    receiver = _caches(layout, 3, seed=2)
    before = _bytes(receiver)
    what = "scales" if poisoned.endswith("scales") else "values"
    with pytest.raises(KVNonFiniteError, match=f"NaN or infinite K/V {what}"):
        _paged(layout, receiver).write(received, [0, 1, 2], 3)
    assert _bytes(receiver) == before
    # The same chunk without the poison is written.
    sender[poisoned][1][2, 1, 0] = 1.0 if poisoned.endswith("scales") else 0.5
    (frame,) = _paged(layout, sender).frames([0, 1, 2], 0, 3, num_tokens=10)
    assert _paged(layout, receiver).write(parse_response(serialize_response(frame)), [0, 1, 2], 3) > 0


@pytest.mark.parametrize(
    ("dtype", "unsigned"),
    [(torch.float16, torch.int16), (torch.bfloat16, torch.int16), (torch.float8_e4m3fn, torch.uint8)],
)
def test_every_bit_pattern_is_judged_as_torch_judges_it(dtype, unsigned):
    width = 8 * torch.empty((), dtype=dtype).element_size()
    patterns = torch.arange(1 << width, dtype=torch.int32).to(unsigned)
    values = patterns.view(dtype).float()
    assert count_non_finite(patterns.numpy().tobytes(), dtype) == int((~torch.isfinite(values)).sum())
    floats = torch.tensor([0.0, -1.0, 3e38, -3e38, NAN, -NAN, INF, -INF, 1e-45])
    assert count_non_finite(floats.numpy().tobytes(), torch.float32) == 4
    assert count_non_finite(bytes(range(256)), torch.int8) == 0


def test_a_nan_first_token_logprob_is_refused():
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
    seq = Sequence("t", [3, 4, 5], SamplingParams(temperature=0.0, logprobs=1), StoppingParams(max_tokens=4))
    seq.block_table = [0]
    caches = _caches(layout, 1, seed=3)
    transfer = KVTransfer(ServedRequest(seq), _paged(layout, caches))
    (frame,) = _paged(layout, _caches(layout, 1, seed=4)).frames([0], 0, 1, num_tokens=3)
    transfer.write(frame)
    done = prefill_pb2.PrefillDone(first_token_id=5, num_prompt_tokens=3, first_token_logprob=-1.5)
    transfer.check_complete(done, vocab_size=100)
    done.top_logprobs.add(token_id=6, logprob=NAN)
    with pytest.raises(KVNonFiniteError, match="NaN logprob"):
        transfer.check_complete(done, vocab_size=100)


def test_a_nan_first_token_logprob_is_what_no_logprobs_asked_for_reads():
    """A request without logprobs gets NaN from the sampler (it skips the log-softmax): not an error."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)
    seq = Sequence("t", [3, 4, 5], SamplingParams(temperature=0.0), StoppingParams(max_tokens=4))
    seq.block_table = [0]
    transfer = KVTransfer(ServedRequest(seq), _paged(layout, _caches(layout, 1, seed=3)))
    (frame,) = _paged(layout, _caches(layout, 1, seed=4)).frames([0], 0, 1, num_tokens=3)
    transfer.write(frame)
    transfer.check_complete(
        prefill_pb2.PrefillDone(first_token_id=5, num_prompt_tokens=3, first_token_logprob=NAN),
        vocab_size=100,
    )


# --- end to end: a prefill tier whose numerics broke ------------------------------------------------


class PoisonedSteps(StepGate):
    """Makes a prefill engine's every step leave NaN (or inf) in its whole cache once it has sampled: the
    KV it sends next has a valid checksum and non-finite scales (int8) or values (fp32), and the first
    token and its logprob are the ones a sound replica sends."""

    def __init__(self, engine, value: float) -> None:
        super().__init__(engine)
        cache = engine.kv_cache
        self._poisoned = [*cache.k_scales, *cache.v_scales] if cache.quantized else [*cache.k, *cache.v]
        self._value = value

    def __call__(self, chunks):
        result = super().__call__(chunks)
        for tensor in self._poisoned:
            tensor.fill_(self._value)
        return result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-nonfinite-model")
    save_tiny_model(directory, 33)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize(("kv_cache_dtype", "value"), [("int8", NAN), ("int8", INF), ("auto", NAN)])
def test_a_prefill_tier_sending_non_finite_kv_is_refused_and_nothing_poisoned_is_cached(
    model_dir, kv_cache_dtype, value
):
    # One prefill step computes the whole prompt, so the poison reaches only what is sent.
    rogue = RunningPrefill(model_dir, kv_cache_dtype=kv_cache_dtype, token_budget=256)
    rogue.gate = PoisonedSteps(rogue.engine, value)
    decode = RunningDecode(
        model_dir,
        kv_cache_dtype=kv_cache_dtype,
        prefill=rogue.address,
        fallback_local=True,
        local_prefill_threshold=32,
    )
    reference = RunningDecode(model_dir, kv_cache_dtype=kv_cache_dtype)
    prompt = prompts_of([130], seed=7)[0]
    # 8 full blocks of the first prompt, then a tail short enough to be prefilled locally over them.
    later = prompt[:128] + prompts_of([10], seed=8)[0]
    try:
        replies = {}
        for name, server in (("decode", decode), ("reference", reference)):
            replies[name] = [
                server.generate(prompt, 6, f"{name}-first", logprobs=1),
                server.generate(later, 6, f"{name}-later", logprobs=1),
            ]
        for got, expected in zip(replies["decode"], replies["reference"], strict=True):
            assert tokens_of(got) == tokens_of(expected)
            logprobs = [lp.logprob for response in got for lp in response.logprobs]
            assert len(logprobs) == 6 and all(math.isfinite(lp) for lp in logprobs)
        stats = decode.stats
        assert stats.attempt_failures == 1 and stats.remote_prefills_failed == 1
        assert stats.fallbacks_local == 1 and stats.remote_prefills_completed == 0
        assert {"decode-first", "decode-later"} <= decode.locally_prefilled_request_ids()
        assert replies["decode"][1][-1].usage.cached_tokens == 128
        for server in (decode, reference):
            assert wait_until(server.pool_is_full)
    finally:
        for server in (decode, reference, rogue):
            server.close()
