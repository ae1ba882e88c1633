"""The front door's validation against the served model's facts, with no engine behind it."""

from __future__ import annotations

import pytest
import torch

from base.errors import InvalidRequestError
from decode_service.front_door.validation import check_fits_pool
from engine.model_facts import ModelFacts
from engine.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_a_request_longer_than_the_whole_pool_is_refused_up_front():
    model = ModelFacts(
        model_name="m",
        vocab_size=64,
        max_model_len=2048,
        eos_token_ids=frozenset(),
        block_size=8,
        num_blocks=4,
        dtype=torch.float32,
        kv_dtype=torch.float32,
        quantization="none",
        enable_prefix_caching=True,
        max_num_seqs=4,
    )
    check_fits_pool(model, 10, 22)
    with pytest.raises(InvalidRequestError, match="needs 5 KV blocks but the server's pool has 4"):
        check_fits_pool(model, 10, 23)
