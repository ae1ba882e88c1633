"""`--quantization int8` served: real decode and prefill servers on loopback over a tiny model. Greedy
output equals Hugging Face on the dequantized weights, aggregated and disaggregated (prompts prefilled
in chunks on the int8 prefill tier, their KV streamed to the int8 decode tier), and tiers whose weight
quantization differs refuse each other at the handshake."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import hf_greedy, save_tiny_model, wait_until
from test_disagg_serving import RunningDecode, RunningPrefill, prompts_of, tokens_of
from test_quantization import dequantized_hf

from decode_service.engine_core.remote_prefill.pool import ReplicaState


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama on disk and the HF reference running its dequantized int8 weights."""
    directory = tmp_path_factory.mktemp("tiny-int8-model")
    return directory, dequantized_hf(save_tiny_model(directory, 41))


def test_int8_tiers_equal_hf_on_dequantized_weights_aggregated_and_disaggregated(model):
    model_dir, reference = model
    lengths = [3, 16, 45, 130, 260]
    prompts = prompts_of(lengths, seed=7)
    max_tokens = [4 + 3 * i for i in range(len(prompts))]
    prefill = RunningPrefill(model_dir, quantization="int8")
    disaggregated = RunningDecode(model_dir, prefill=prefill.address, quantization="int8")
    aggregated = RunningDecode(model_dir, quantization="int8")
    try:
        assert [r.state for r in disaggregated.pool.replicas] == [ReplicaState.READY]

        def run(server: RunningDecode) -> list[list[int]]:
            with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
                futures = [
                    pool.submit(server.generate, prompts[i], max_tokens[i], f"q{i}")
                    for i in range(len(prompts))
                ]
                return [tokens_of(future.result(180)) for future in futures]

        remote, local = run(disaggregated), run(aggregated)
        for i, prompt in enumerate(prompts):
            expected = hf_greedy(reference, prompt, max_tokens[i])
            assert remote[i] == expected, f"disaggregated prompt of {len(prompt)} tokens diverged"
            assert local[i] == expected, f"aggregated prompt of {len(prompt)} tokens diverged"
        assert disaggregated.stats.remote_prefills_completed == len(prompts)
        assert prefill.prefilled_request_ids() == {f"q{i}" for i in range(len(prompts))}
        assert wait_until(disaggregated.pool_is_full) and wait_until(aggregated.pool_is_full)
        assert wait_until(prefill.pool_is_full)
    finally:
        disaggregated.close()
        aggregated.close()
        prefill.close()


def test_tiers_with_other_weight_quantization_refuse_each_other(model, caplog):
    model_dir, _ = model
    plain_prefill = RunningPrefill(model_dir)
    int8_prefill = RunningPrefill(model_dir, quantization="int8")
    try:
        with caplog.at_level(logging.ERROR, logger="decode_service.engine_core.remote_prefill.pool"):
            int8_decode = RunningDecode(model_dir, prefill=plain_prefill.address, quantization="int8")
            plain_decode = RunningDecode(model_dir, prefill=int8_prefill.address)
        try:
            for decode in (int8_decode, plain_decode):
                assert [r.state for r in decode.pool.replicas] == [ReplicaState.INCOMPATIBLE]
            refusals = [
                r.getMessage() for r in caplog.records if "refusing prefill replica" in r.getMessage()
            ]
            assert len(refusals) == 2 and all("+int8-weights" in m for m in refusals)
            assert not plain_prefill.prefilled_request_ids() and not int8_prefill.prefilled_request_ids()
        finally:
            int8_decode.close()
            plain_decode.close()
    finally:
        plain_prefill.close()
        int8_prefill.close()
