"""The in-process engine API both tiers drive: build sequences, run scheduled steps, free blocks.

The engine executes whatever step it is given; *deciding* the step (admission, chunk sizes,
preemption) is the scheduler's job in the tier that owns the queue. `generate` is a small FCFS
driver for tests, demos and benchmarks, not a scheduler.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from base.errors import InvalidRequestError, OutOfBlocksError, TandemError
from engine import quantization, quantized_layers
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.grammar import GrammarDeadEndError, GrammarMask, GrammarState, GrammarViolationError
from engine.grammar_budget import GrammarFillTimeoutError
from engine.kv_cache import KVCache
from engine.kv_events import MEDIUM_BY_DEVICE, KVEventRecorder, KVEventsConfig
from engine.model_facts import ModelFacts
from engine.model_runner import ModelRunner, ScheduledChunk
from engine.models import build_model
from engine.params import SamplingParams, StoppingParams
from engine.sampler import Sampler, SamplerOutput, TokenHistory, argmax_suffices
from engine.sequence import FinishReason, Sequence
from engine.speculation import NgramDrafts, SpeculationStats
from engine.tokenizer import Tokenizer
from kernels.kv_quant import check_device_supports
from kernels.platform import choose_platform

if TYPE_CHECKING:
    from engine.kv_event_publisher import KVEventPublisher

logger = logging.getLogger(__name__)


def kv_namespace(
    model_config: ModelConfig,
    dtype: torch.dtype,
    block_size: int,
    kv_dtype: torch.dtype | None = None,
    weight_quantization: str = quantization.NONE,
) -> bytes:
    """What makes cached KV reusable: the architecture, the model and KV dtypes, the block size and the
    weights' quantization (other weights compute other KV).

    It roots every prefix-cache hash chain, so the two tiers (whose compatibility hash already covers
    model and layout) compute equal chains for equal prompts and salts. A KV dtype other than the
    model's (a quantized cache) is part of it; the model's own leaves the namespace as it always was.
    """
    stored = "" if kv_dtype in (None, dtype) else f"|kv={kv_dtype}"
    weights = "" if weight_quantization == quantization.NONE else f"|{weight_quantization}"
    return f"{model_config!r}|{dtype}|{block_size}{stored}{weights}".encode()


@dataclass
class TokenOutput:
    """One sampled token of one sequence, ready to stream."""

    seq: Sequence
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]
    finish_reason: FinishReason | None
    # Tokens the grammar forced after the sampled one (jump-forward): appended, their KV not computed yet.
    forced_token_ids: tuple[int, ...] = ()
    # Why this sequence alone could not go on (its grammar allowed no token, or refused the sampled one):
    # it is aborted, `token_id` was not appended, and its request ends with this error alone.
    error: TandemError | None = None
    # Draft tokens the step verified and kept, appended before `token_id`: (id, logprob, top logprobs).
    accepted_drafts: tuple[tuple[int, float, list[tuple[int, float]]], ...] = ()

    @property
    def token_ids(self) -> list[int]:
        """Every token this output appended, in order."""
        return [*(d[0] for d in self.accepted_drafts), self.token_id, *self.forced_token_ids]


@dataclass
class GenerateRequest:
    """Input of the simple driver `Engine.generate`."""

    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stopping: StoppingParams = field(default_factory=StoppingParams)
    cache_salt: str = ""
    grammar: GrammarState | None = None


class Engine:
    """Model, paged cache, block manager, sampler and tokenizer of one replica."""

    def __init__(
        self,
        model_config: ModelConfig,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        tokenizer: Tokenizer | None,
        config: EngineConfig,
        block_order: SequenceOf[int] | None = None,
        model_name: str = "model",
    ) -> None:
        self.model_config = model_config
        self.config = config
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.device = torch.device(config.device)
        self.dtype = config.dtype
        self.platform = choose_platform(
            self.device,
            config.dtype,
            quantized_layers.linear_module(config.quantization),
            config.attention_backend,
            quantized_embedding=quantized_layers.embedding_module(config.quantization),
        )
        self.backend = self.platform.attention
        check_device_supports(config.kv_dtype, self.device, self.backend.name)
        with torch.device("meta"):
            model = build_model(model_config, self.backend)
        model = model.to_empty(device=self.device).to(config.dtype)
        if model_config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        # Before loading: the checkpoint is quantized as it is copied in (the empty full-precision
        # weights this drops were never written, so they never took memory).
        self.platform.quantize_linears(model.layers)
        self.platform.quantize_embeddings(model)
        # A state dict (tests' in-memory models) or a stream of (name, tensor) (a checkpoint on disk,
        # `Checkpoint.tensors`), each tensor converted or quantized into its place as it comes.
        model.load_weights(weights.items() if isinstance(weights, Mapping) else weights)
        self.platform.specialize(model)
        self.model = model.eval()
        # What the front door knows of this model; the pool, EOS and length rules below are its.
        self.facts = ModelFacts.of(model_config, config, tokenizer, model_name)
        self.block_size = self.facts.block_size
        self.kv_dtype = self.facts.kv_dtype
        num_blocks = self.facts.num_blocks
        self.kv_cache = KVCache.allocate(
            model_config, num_blocks, self.block_size, self.kv_dtype, self.device
        )
        self.block_manager = BlockManager(
            num_blocks,
            self.block_size,
            enable_caching=config.enable_prefix_caching,
            namespace=kv_namespace(
                model_config, config.dtype, self.block_size, self.kv_dtype, config.quantization
            ),
            order=block_order,
            layout=model_config.kv_layout,
        )
        # A sliding-window group drops blocks after every step; without one the step skips that pass.
        self._sliding = self.block_manager.sliding
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.sampler = Sampler()
        # Called with the seconds each step spent filling grammar masks (metrics); None: nobody listens.
        self.grammar_fill_observer: Callable[[float], None] | None = None
        self.eos_token_ids = self.facts.eos_token_ids
        self.max_model_len = self.facts.max_model_len
        self.speculative = config.speculative
        self.speculation_stats = SpeculationStats()
        # Where each step's prefix-cache events go (`start_kv_events`); None: they are not recorded.
        self.kv_events: KVEventPublisher | None = None
        logger.info(
            "engine ready",
            extra={
                "model": model_name,
                "num_blocks": num_blocks,
                "block_size": self.block_size,
                # What the pool holds against what the running sequences can fill (a default pool is
                # capped there: `CacheConfig.fit_to_sequences`).
                "kv_pool_tokens": num_blocks * self.block_size,
                "max_model_len": self.max_model_len,
                "max_num_seqs": config.max_num_seqs,
                "dtype": str(config.dtype),
                "kv_dtype": str(self.kv_dtype),
                "quantization": config.quantization,
                "backend": self.backend.name,
            },
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: EngineConfig, **kwargs) -> Engine:
        """Load a local Hugging Face checkpoint directory (safetensors, config, tokenizer), streaming its
        weights into the model one tensor at a time (`engine.checkpoint_stream`): the load peaks at about
        the resident model, never at a second copy of the checkpoint."""
        from engine.checkpoints import open_checkpoint

        checkpoint = open_checkpoint(Path(model_dir))
        tokenizer = Tokenizer.from_pretrained(model_dir)
        name = kwargs.pop("model_name", Path(model_dir).name)
        model_config = ModelConfig.from_hf(checkpoint.config)
        return cls(model_config, checkpoint.tensors(), tokenizer, config, model_name=name, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def make_sequence(
        self,
        prompt_token_ids: SequenceOf[int],
        sampling: SamplingParams,
        stopping: StoppingParams,
        request_id: str | None = None,
        cache_salt: str = "",
        grammar: GrammarState | None = None,
    ) -> Sequence:
        """Validate a request against this model and wrap it in a `Sequence` (constrained by `grammar`).

        The checks are the facts' (`ModelFacts.make_sequence`): the front door runs them with no engine."""
        return self.facts.make_sequence(prompt_token_ids, sampling, stopping, request_id, cache_salt, grammar)

    def fork(self, parent: Sequence, sampling: SamplingParams, share_kv: bool) -> Sequence:
        """Another completion of `parent`'s prompt (a choice of a request with n > 1).

        With `share_kv` the child reuses the parent's computed prompt KV: it takes a reference to every
        full block before the last prompt token (a sliding group's: those the last token's query reads)
        and, in each KV group, a private copy of the block holding that token, which it recomputes (one
        token, like a decode step) to get logits of its own. Without it the child holds no blocks and
        its prompt is prefilled like a new request's. Raises OutOfBlocksError when sharing needs a block
        the pool does not have.
        """
        child = Sequence(
            parent.request_id,
            parent.token_ids[: parent.num_prompt_tokens],
            sampling,
            parent.stopping,
            parent.arrival_time,
            parent.cache_salt,
            parent.grammar.fork() if parent.grammar is not None else None,
        )
        if not share_kv:
            return child
        if parent.num_computed_tokens < parent.num_prompt_tokens:
            raise ValueError(f"{parent.request_id}: cannot share a prompt whose KV is not computed yet")
        last = parent.num_prompt_tokens - 1
        num_shared = last // self.block_size
        manager = self.block_manager
        if manager.num_free_blocks < manager.num_groups:
            raise OutOfBlocksError(f"{parent.request_id}: no free KV block for a choice's last prompt block")
        manager.fork(parent, child, reads_from=last)
        manager.extend(child, num_shared * self.block_size + 1)
        for parent_table, child_table in zip(parent.block_tables, child.block_tables, strict=True):
            self.kv_cache.copy_block(parent_table[num_shared], child_table[num_shared])
        child.num_computed_tokens = last
        return child

    # -- KV events: the prefix cache's changes, for cache-aware routers (`engine.kv_events`) ------------

    def start_kv_events(self, config: KVEventsConfig) -> None:
        """Publish this engine's prefix-cache events as `config` says (nothing when it leaves them off).

        Opens the sockets now, so a taken port or a bad endpoint raises ConfigError at start."""
        if not config.enabled:
            return
        from engine.kv_event_publisher import KVEventPublisher

        publisher = KVEventPublisher(config)
        publisher.start()
        self.attach_kv_events(publisher)

    def attach_kv_events(self, publisher: KVEventPublisher) -> None:
        """Record the block manager's registrations and evictions from now on, and hand them to
        `publisher` once per step (`start_kv_events` does this with a publisher it starts)."""
        medium = MEDIUM_BY_DEVICE.get(self.device.type, self.device.type.upper())
        manager = self.block_manager
        manager.events = KVEventRecorder(self.block_size, medium, manager.windows)
        self.kv_events = publisher

    def stop_kv_events(self) -> None:
        """Stop recording and close the publisher (after the engine thread stopped stepping)."""
        publisher, self.kv_events = self.kv_events, None
        self.block_manager.events = None
        if publisher is not None:
            publisher.close()

    def _publish_kv_events(self) -> None:
        """Hand what the block manager recorded since the last call to the publisher, as one batch (none
        when nothing changed, or events are off)."""
        recorder = self.block_manager.events
        if recorder is None or self.kv_events is None:
            return
        events = recorder.take()
        if events:
            self.kv_events.publish(events)

    def step(self, chunks: list[ScheduledChunk]) -> list[TokenOutput]:
        """Run one step (`_step`); with KV events on, the cache changes since the last batch (this step's
        registrations, the evictions of the allocations before it) leave as one batch."""
        outputs = self._step(chunks)
        self._publish_kv_events()
        return outputs

    def _step(self, chunks: list[ScheduledChunk]) -> list[TokenOutput]:
        """Run one forward over the chunks and sample a token for every sequence it completes.

        The caller has grown each block table to cover the chunk (and its draft). Blocks the forward
        filled are registered in the prefix cache, then sliding-window blocks no later query can read
        are released (in this same step). A chunk with a draft keeps the draft tokens that equal what
        was sampled after their predecessors, and one sampled token more (`engine.speculation`); the
        rejected tokens' KV lies past the sequence's computed tokens and is overwritten when they are
        computed. Finished sequences keep their other blocks until the caller calls `free` — in the
        same iteration, for continuous batching.
        """
        if not chunks:
            return []
        hidden = self.runner.execute(chunks)
        sampled = [c for c in chunks if c.completes_sequence]
        manager = self.block_manager
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.num_tokens
            if not chunk.draft_token_ids:
                manager.commit(chunk.seq)
        if self._sliding:
            for chunk in chunks:
                manager.release_slid_out(chunk.seq)
        if not sampled:
            return []
        rows = [
            (c.seq, c.draft_token_ids[:ahead]) for c in sampled for ahead in range(len(c.draft_token_ids) + 1)
        ]
        result = self.sample(hidden, rows)
        token_ids = result.token_ids.tolist()
        logprobs = result.logprobs.tolist()
        top_ids, top_lps = result.top_token_ids.tolist(), result.top_logprobs.tolist()
        outputs = []
        row = 0
        for chunk in sampled:
            seq, draft = chunk.seq, chunk.draft_token_ids
            n = seq.sampling.logprobs
            tokens = [
                (token_ids[r], logprobs[r], list(zip(top_ids[r][:n], top_lps[r][:n], strict=True)))
                for r in range(row, row + len(draft) + 1)
            ]
            row += len(draft) + 1
            if draft:
                outputs.append(self._verify(seq, draft, tokens))
            else:
                outputs.append(self._append_sampled(seq, *tokens[0]))
        return outputs

    def _verify(
        self, seq: Sequence, draft: tuple[int, ...], sampled: list[tuple[int, float, list[tuple[int, float]]]]
    ) -> TokenOutput:
        """Append what a draft's verification sampled: each draft token while it equals the token sampled
        in its place, then the first sampled token that differs (or the one after the whole draft)."""
        kept: list[tuple[int, float, list[tuple[int, float]]]] = []
        for guess, token in zip(draft, sampled, strict=False):
            if token[0] != guess:
                break
            seq.append_token(guess, self.eos_token_ids, self.max_model_len)
            seq.num_computed_tokens += 1  # its KV was computed in this forward
            kept.append(token)
            if seq.is_finished:
                break
        self.speculation_stats.record(len(draft), len(kept))
        if seq.drafts is not None:
            seq.drafts.record(len(draft), len(kept))
        if seq.is_finished:
            last = kept.pop()
        else:
            last = sampled[len(kept)]
            seq.append_token(last[0], self.eos_token_ids, self.max_model_len)
        self.block_manager.commit(seq)
        if self._sliding:
            self.block_manager.release_slid_out(seq)
        return TokenOutput(seq, *last, seq.finish_reason, accepted_drafts=tuple(kept))

    def propose_draft(self, seq: Sequence, limit: int, batch_size: int = 1) -> tuple[int, ...]:
        """Up to `limit` draft tokens for `seq`'s next decode step among `batch_size` decoding sequences;
        none when this engine does not speculate, the request opted out, a grammar constrains it, its
        drafts would not pay (`NgramDrafts.draft_length`), or its context holds no match."""
        if (
            limit <= 0
            or not self.speculative.enabled
            or seq.grammar is not None
            or seq.sampling.disable_speculation
        ):
            return ()
        if seq.drafts is None:
            seq.drafts = NgramDrafts(self.speculative)
        # Admission checked that prompt + max_tokens fits the context, so max_tokens bounds the draft.
        room = min(limit, seq.stopping.max_tokens - seq.num_output_tokens - 1)
        if room <= 0:
            return ()
        length = min(room, seq.drafts.draft_length(batch_size))
        return tuple(seq.drafts.propose(seq.token_ids, length)) if length > 0 else ()

    def sample(
        self, hidden: torch.Tensor, rows: SequenceOf[tuple[Sequence, tuple[int, ...]]]
    ) -> SamplerOutput:
        """The LM head and the sampler over `hidden`: one final hidden state per row of `rows`, each a
        sequence and the draft tokens taken as appended to it (empty: the sequence as it stands).

        When every row only wants its argmax, the LM head answers directly and the vocabulary-wide
        logits are never written (the sampler would return exactly that argmax). Otherwise one LM-head
        pass writes every row's logits: splitting the batch would read the head's weights twice, which
        costs more than the logits of the greedy rows. Grammar masks are filled for constrained rows only
        (a constrained sequence never drafts).
        """
        params = [s.sampling for s, _ in rows]
        suppressed = [s.suppressed_token_ids(self.eos_token_ids, len(ahead)) for s, ahead in rows]
        grammars = [s.grammar for s, _ in rows]
        if all(g is None or not g.active for g in grammars) and argmax_suffices(params, suppressed):
            return SamplerOutput.without_logprobs(self.model.greedy_tokens(hidden))
        fill_start = time.perf_counter()
        mask = GrammarMask.fill(grammars, self.vocab_size)
        if mask is not None and self.grammar_fill_observer is not None:
            self.grammar_fill_observer(time.perf_counter() - fill_start)
        return self.sampler(
            self.model.compute_logits(hidden),
            params,
            [s.num_tokens + len(ahead) for s, ahead in rows],
            suppressed,
            [
                TokenHistory([*s.token_ids, *ahead] if ahead else s.token_ids, s.num_prompt_tokens)
                for s, ahead in rows
            ],
            mask,
        )

    def append_token_computed_elsewhere(
        self, seq: Sequence, token_id: int, logprob: float, top_logprobs: SequenceOf[tuple[int, float]]
    ) -> TokenOutput:
        """Another replica computed `seq`'s whole history (its KV is already in `seq`'s blocks) and sampled
        the next token: mark the history computed and append that token exactly as `step` would, so stop
        rules and finishing apply (the token may end the request)."""
        seq.num_computed_tokens = seq.num_tokens
        self.block_manager.commit(seq)
        if self._sliding:
            self.block_manager.release_slid_out(seq)
        # Not left for the next step: when this token ends the request, none may come for a while.
        self._publish_kv_events()
        return self._append_sampled(seq, token_id, logprob, list(top_logprobs[: seq.sampling.logprobs]))

    def _append_sampled(
        self, seq: Sequence, token_id: int, logprob: float, top_logprobs: list[tuple[int, float]]
    ) -> TokenOutput:
        if seq.grammar is None:  # the per-token path of unconstrained requests
            seq.append_token(token_id, self.eos_token_ids, self.max_model_len)
            return TokenOutput(seq, token_id, logprob, top_logprobs, seq.finish_reason)
        try:
            seq.append_token(token_id, self.eos_token_ids, self.max_model_len)
            forced: list[int] = []
            for forced_id in self._jump_forward(seq):
                if seq.is_finished:  # a forced token was a stop token
                    break
                seq.append_token(forced_id, self.eos_token_ids, self.max_model_len)
                forced.append(forced_id)
        except (GrammarDeadEndError, GrammarFillTimeoutError, GrammarViolationError) as exc:
            # This sequence's grammar cannot go on (or costs too much to); the others sampled in the same
            # step can.
            log = logger.error if isinstance(exc, GrammarViolationError) else logger.warning
            log("%s: ending it alone: %s", seq.request_id, exc)
            seq.abort()
            return TokenOutput(seq, token_id, logprob, top_logprobs, seq.finish_reason, error=exc)
        return TokenOutput(seq, token_id, logprob, top_logprobs, seq.finish_reason, tuple(forced))

    def _jump_forward(self, seq: Sequence) -> list[int]:
        """The tokens `seq`'s grammar forces next, up to its length limits (none for requests that want
        logprobs: a forced token has no distribution to report). Appending them skips a forward per token;
        the next step computes their KV as one chunk, then samples after them."""
        if (
            seq.grammar is None
            or seq.is_finished
            or seq.sampling.logprobs
            or not self.config.grammar_jump_forward
        ):
            return []
        forced = seq.grammar.jump_forward_tokens()
        if not forced:
            return forced
        room = min(seq.stopping.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
        return forced[: max(room, 0)]

    def warm_up(self) -> None:
        """One single-token forward and sample, so the first real request does not pay for lazy init."""
        seq = self.make_sequence(
            [0], SamplingParams(temperature=0.0), StoppingParams(max_tokens=1, ignore_eos=True), "warm-up"
        )
        self.allocate(seq, seq.num_tokens)
        try:
            self.step([ScheduledChunk(seq, seq.num_tokens)])
        finally:
            self.free(seq)

    # -- the KV pool: what schedulers use to reserve and return blocks ---------------------------------

    def allocate(self, seq: Sequence, num_tokens: int, reads_from: int | None = None) -> None:
        """Grow a sequence's block tables to hold `num_tokens` tokens; all or nothing (OutOfBlocksError).

        A sequence without blocks first takes its longest cached prefix (those tokens count as computed),
        so only the rest is allocated and computed. `reads_from`: the first position this replica will
        query when the KV before it comes from elsewhere (`BlockManager.allocate`).
        """
        self.block_manager.allocate(seq, num_tokens, reads_from)

    def can_allocate(self, seq: Sequence, num_tokens: int, reads_from: int | None = None) -> bool:
        """Whether `allocate(seq, num_tokens, reads_from)` would succeed now."""
        return self.block_manager.can_allocate(seq, num_tokens, reads_from)

    def admit(self, seq: Sequence, num_tokens: int, chunk_tokens: int) -> None:
        """Reserve a new sequence's blocks for a history computed here in chunks of at most `chunk_tokens`
        tokens, each grown with `allocate` before its step (`BlockManager.admit`): with sliding-window
        groups only the most blocks a chunk and its window can hold is reserved, not the whole prompt."""
        self.block_manager.admit(seq, num_tokens, chunk_tokens)

    def catch_up_prefix(self, seq: Sequence) -> int:
        """Reuse the prefix blocks registered since `seq`'s admission, before it computes any
        (`BlockManager.catch_up_prefix`); returns the tokens it no longer computes."""
        return self.block_manager.catch_up_prefix(seq)

    def can_admit(self, seq: Sequence, num_tokens: int, chunk_tokens: int) -> bool:
        """Whether `admit(seq, num_tokens, chunk_tokens)` would succeed now."""
        return self.block_manager.can_admit(seq, num_tokens, chunk_tokens)

    def admission_blocks(self, seq: Sequence, num_tokens: int, chunk_tokens: int) -> int:
        """Free blocks `admit(seq, num_tokens, chunk_tokens)` would consume, reserved ones included."""
        return self.block_manager.admission_blocks(seq, num_tokens, chunk_tokens)

    def holds_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """True when `seq`'s blocks already hold `num_tokens` tokens (`allocate` would add nothing); the
        scheduler's per-token fast path, so it is one comparison."""
        return len(seq.block_tables[0]) * self.block_manager.block_size >= num_tokens

    def blocks_needed(self, seq: Sequence, num_tokens: int, reads_from: int | None = None) -> int:
        """Free blocks `allocate(seq, num_tokens, reads_from)` would take, over all KV groups (cache hits
        it reuses cost none, unless they must be revived from the evictable LRU)."""
        return self.block_manager.blocks_needed(seq, num_tokens, reads_from)

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` the prefix cache would serve if it were admitted now (for cost estimates)."""
        return self.block_manager.cached_prefix_tokens(seq)

    def prefix_hash(self, seq: Sequence, num_blocks: int) -> bytes:
        """The prefix-cache chain hash of `seq`'s first `num_blocks` full blocks (equal on both tiers for
        equal tokens and salt): how one tier proves to the other which blocks it holds."""
        return self.block_manager.prefix_hash(seq, num_blocks)

    def free(self, seq: Sequence) -> None:
        """Drop a sequence's block references (finish, abort or preemption); its full blocks stay cached."""
        self.block_manager.free(seq)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return self.block_manager.blocks_for_tokens(num_tokens)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_blocks(self) -> int:
        """The KV pool's size in blocks."""
        return self.block_manager.num_blocks

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool in use."""
        return self.block_manager.usage

    def generate(
        self,
        requests: SequenceOf[GenerateRequest],
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
    ) -> list[Sequence]:
        """Run requests to completion FCFS with chunked prefill: decodes first, then prompt chunks.

        Admits a request only when its uncached prompt fits in free blocks (a sliding group's: the most a
        chunk and its window hold, `admit`). A decoding sequence whose next block is not free sits out
        steps until finishing sequences free one; when none can grow, the latest admitted is preempted
        and recomputed later. A speculating engine drafts by the decode tier's rule (`propose_draft`, the
        running sequences as the batch). Meant for tests and benchmarks of the engine alone.
        """
        budget = max_num_batched_tokens or self.config.max_num_batched_tokens
        max_seqs = max_num_seqs or self.config.max_num_seqs
        waiting = [
            self.make_sequence(
                r.prompt_token_ids, r.sampling, r.stopping, cache_salt=r.cache_salt, grammar=r.grammar
            )
            for r in requests
        ]
        done_order = list(waiting)
        running: list[Sequence] = []
        # Set by a preemption, cleared when a sequence finishes: the preempted one is not readmitted into
        # the very shortage that preempted it.
        hold_admission = False
        while waiting or running:
            while (
                waiting
                and not hold_admission
                and len(running) < max_seqs
                and self.can_admit(waiting[0], waiting[0].num_tokens + 1, budget)
            ):
                seq = waiting.pop(0)
                self.admit(seq, seq.num_tokens + 1, budget)
                running.append(seq)
            if not running:
                raise InvalidRequestError("a prompt does not fit in the KV pool")
            chunks, left = [], budget
            for seq in sorted(running, key=lambda s: s.num_uncomputed_tokens > 1):
                take = min(seq.num_uncomputed_tokens, left)
                if take == 0:
                    break
                decoding = take == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
                if decoding and not self.can_allocate(seq, seq.num_computed_tokens + take + 1):
                    continue  # it waits for the blocks that finishing sequences free
                self.allocate(seq, seq.num_computed_tokens + take + 1)
                draft = self.propose_draft(seq, left - take, len(running)) if decoding else ()
                if draft and self.can_allocate(seq, seq.num_tokens + len(draft)):
                    self.allocate(seq, seq.num_tokens + len(draft))
                else:
                    draft = ()
                chunks.append(ScheduledChunk(seq, take, draft))
                left -= take + len(draft)
            if not chunks:
                if len(running) == 1:
                    raise OutOfBlocksError("one request's decoding does not fit in the KV pool")
                # No running sequence can grow: the latest admitted gives its blocks back and waits to be
                # recomputed (prompt and output so far), as the decode tier's scheduler preempts.
                victim = running.pop()
                self.free(victim)
                waiting.insert(0, victim)
                hold_admission = True
                continue
            for out in self.step(chunks):
                if out.finish_reason is not None:
                    running.remove(out.seq)
                    self.free(out.seq)
                    hold_admission = False
        return done_order
