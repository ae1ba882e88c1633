"""`--quantization int8` on the real default model, SmolLM2-135M-Instruct: greedy chat replies equal
Hugging Face running the dequantized weights (q * scale: decoder linears and the tied embedding / LM
head), token for token."""

from __future__ import annotations

import pytest
from test_quantization import dequantized_hf
from test_real_model_parity import assert_chat_replies_match_hf

# Held out: none of these prompts is used anywhere else in the tests.
CHATS = [
    "Name two rivers in Africa.",
    "What does a compiler do? One sentence.",
    "Give me a short tip for sleeping better.",
    "How many legs does a spider have?",
]
NEW_TOKENS = 48


@pytest.mark.slow
@pytest.mark.real_model
def test_smollm2_int8_greedy_matches_transformers_on_dequantized_weights(real_model_dir):
    replies = assert_chat_replies_match_hf(
        real_model_dir, CHATS, NEW_TOKENS, num_blocks=96, reference=dequantized_hf, quantization="int8"
    )
    # The fp32 model's first reply names the Nile; the spider reply (fp32's too) never says how many legs.
    assert "Nile" in replies[0], "an African river"
