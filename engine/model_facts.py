"""What a server knows about its model without holding it: names, sizes, limits and the tokenizer.

The decode front door (APIs, validation, tokenization, text) needs these facts but never the weights or
the KV cache, so it can run in a process that does not load them: `ModelFacts.load` reads a checkpoint's
config and tokenizer only. The engine builds its own from the same rules (`ModelFacts.of`) and checks
every request with `make_sequence` here, so the two processes can never disagree about either.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path

import torch

from base.errors import InvalidRequestError
from engine.config import EngineConfig, ModelConfig
from engine.grammar import GrammarState
from engine.params import SamplingParams, StoppingParams
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelFacts:
    """The served model as the front door sees it; equal facts describe interchangeable replicas."""

    model_name: str
    vocab_size: int
    # The longest prompt + answer a sequence may have: the config's cap, never past the model's positions.
    max_model_len: int
    # The model config's EOS ids and the tokenizer's (chat models often end turns with another token).
    eos_token_ids: frozenset[int]
    block_size: int
    # The KV pool's size in blocks, as the engine allocates it.
    num_blocks: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    quantization: str
    enable_prefix_caching: bool
    max_num_seqs: int
    # Shared with the engine that built these facts (a chat template set on one is set on both); not
    # compared, since two loads of one tokenizer are equal in behaviour but not as objects.
    tokenizer: Tokenizer | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(
        cls, model_config: ModelConfig, config: EngineConfig, tokenizer: Tokenizer | None, model_name: str
    ) -> ModelFacts:
        """The facts of `model_config` served under `config`: the one place their rules live."""
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        positions = model_config.max_position_embeddings
        max_model_len = min(config.max_model_len or positions, positions)
        sequence_tokens = max_model_len * config.max_num_seqs
        return cls(
            model_name=model_name,
            vocab_size=model_config.vocab_size,
            max_model_len=max_model_len,
            eos_token_ids=frozenset(eos),
            block_size=config.cache.block_size,
            num_blocks=config.cache.resolve_num_blocks(model_config, config.kv_dtype, sequence_tokens),
            dtype=config.dtype,
            kv_dtype=config.kv_dtype,
            quantization=config.quantization,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_seqs=config.max_num_seqs,
            tokenizer=tokenizer,
        )

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig, model_name: str | None = None) -> ModelFacts:
        """The facts of a local checkpoint directory under `config`, from its config and tokenizer alone
        (its weights are never read); equal to those of `Engine.from_pretrained(model_dir, config)`."""
        from engine.model_store import load_hf_config

        hf_config = load_hf_config(Path(model_dir))
        tokenizer = Tokenizer.from_pretrained(model_dir)
        name = model_name if model_name is not None else Path(model_dir).name
        return cls.of(ModelConfig.from_hf(hf_config), config, tokenizer, name)

    def make_sequence(
        self,
        prompt_token_ids: SequenceOf[int],
        sampling: SamplingParams,
        stopping: StoppingParams,
        request_id: str | None = None,
        cache_salt: str = "",
        grammar: GrammarState | None = None,
    ) -> Sequence:
        """Validate a request against this model and wrap it in a `Sequence` (constrained by `grammar`)."""
        self.check_request(prompt_token_ids, sampling, stopping)
        return Sequence(
            request_id or uuid.uuid4().hex,
            prompt_token_ids,
            sampling,
            stopping,
            cache_salt=cache_salt,
            grammar=grammar,
        )

    def check_request(
        self, prompt_token_ids: SequenceOf[int], sampling: SamplingParams, stopping: StoppingParams
    ) -> None:
        """Raise InvalidRequestError naming what this model cannot serve in a request."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt has no tokens")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(prompt_token_ids)} tokens; max_model_len is {self.max_model_len}"
            )
        sampling.validate()
        stopping.validate()
        if len(prompt_token_ids) + stopping.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({stopping.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """KV blocks that hold `num_tokens` tokens."""
        return (num_tokens + self.block_size - 1) // self.block_size
