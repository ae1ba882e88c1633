"""A tiny random-weight model with a tiny byte-level BPE tokenizer, built in-process with no network.

Tests build their models with it, and `tandem selftest` serves one to prove that an installation (the
container image's build included) starts both tiers and answers. The tokenizer mirrors the shape of
SmolLM2-Instruct's (byte-level BPE, ChatML template, the same three special tokens at ids 0-2) at a
vocabulary small enough for tiny random-weight models. The training text mixes English, CJK and emoji
with few repeats, so multi-byte characters stay split across several tokens: that is what exercises
the incremental detokenizer's partial-UTF-8 handling.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

ENDOFTEXT_ID = 0
IM_START_ID = 1
IM_END_ID = 2

# Every token id the tiny tokenizer can produce is below this; models built for it use this vocab size.
TINY_VOCAB_SIZE = 512

# Both end a generation: <|im_end|> is the tokenizer's eos (chat turns), <|endoftext|> the document end.
TINY_EOS_TOKEN_IDS = (IM_END_ID, ENDOFTEXT_ID)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. A serving system turns prompts into tokens, "
    "runs the model one step at a time and streams text back to the client as soon as it is ready.",
    "Prefill reads the whole prompt at once and fills the key and value cache; decode then adds one "
    "token per step for every running sequence, and finished sequences free their blocks at once.",
    "Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is "
    "the capital of France, and Berlin is the capital of Germany.",
    "Numbers and punctuation matter too: 1, 2, 3, 42, 100; (yes) [no] {maybe} - a/b = c * d + e.",
    "The system answers questions, writes stories and explains things. Once upon a time there was a "
    "little robot who liked to count the stars in the sky every night before it went to sleep.",
    "東京は日本の首都です。私は毎朝コーヒーを飲みます。今日は天気がいいですね。",
    "北京是中国的首都。我喜欢学习新的语言。你好，世界！",
    "서울은 한국의 수도입니다. 안녕하세요!",
    "Emoji: 😀 🎉 🚀 🌍 🐍 ❤️ 👍🏽 — and accents: café, naïve, señor, Ångström.",
)


def _train_bpe() -> Tokenizer:
    """Train the byte-level BPE; the trainer is deterministic for a fixed corpus and settings."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so that frequent English pairs merge well before the rare multi-byte ones.
    tokenizer.train_from_iterator(list(_TRAINING_TEXT) * 4, trainer=trainer)
    return tokenizer


def build_tiny_tokenizer(directory: Path) -> Path:
    """Write the tiny tokenizer (and a generation_config.json naming its eos ids) into `directory`.

    The result loads with `transformers.AutoTokenizer.from_pretrained(directory)` and with
    `engine.tokenizer.Tokenizer.from_pretrained(directory)`; `len(tokenizer) == TINY_VOCAB_SIZE`.
    Returns `directory`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backend = _train_bpe()
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if backend.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token!r} did not get id {token_id}")
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token=IM_END,
        unk_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        chat_template=CHATML_TEMPLATE,
        model_max_length=8192,
    )
    if len(hf_tokenizer) != TINY_VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer has {len(hf_tokenizer)} tokens, expected {TINY_VOCAB_SIZE}")
    hf_tokenizer.save_pretrained(directory)
    generation_config = {"eos_token_id": list(TINY_EOS_TOKEN_IDS), "pad_token_id": ENDOFTEXT_ID}
    (directory / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    return directory


def build_tiny_model(directory: Path, seed: int = 0) -> Path:
    """Write a tiny random-weight Llama with the tiny tokenizer into `directory`: a model directory any
    tier loads like a real one (two layers, 64-wide, fp32). Returns `directory`."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=TINY_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        eos_token_id=list(TINY_EOS_TOKEN_IDS),
        bos_token_id=None,
        pad_token_id=ENDOFTEXT_ID,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return build_tiny_tokenizer(directory)
