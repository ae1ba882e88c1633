"""Turns one scheduled step into tensors, runs the model, and returns the hidden states to sample from."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from engine.kv_cache import KVCache
from engine.models.decoder import CausalLM
from engine.sequence import Sequence
from kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute `num_tokens` more tokens of `seq`, starting at its `num_computed_tokens`.

    `draft_token_ids` (a decode chunk only) are guesses at the tokens after it (`engine.speculation`):
    their KV is computed in the same forward and a token is sampled after each of them.
    """

    seq: Sequence
    num_tokens: int
    draft_token_ids: tuple[int, ...] = ()

    @property
    def completes_sequence(self) -> bool:
        """True when this chunk reaches the last known token, so a new token gets sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


class ModelRunner:
    """Owns the model and the cache tensors; knows nothing about queues or policies."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        layout = kv_cache.layout
        self.num_groups = layout.num_groups if layout is not None else 1
        # Sliding tables hold NULL_BLOCK entries, which become block 0 in the tensors.
        self.sliding = layout is not None and layout.is_hybrid

    def prepare(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's input tensors and attention metadata, built from plain lists with one tensor each:
        per-row tensors (block tables) and generator-driven loops cost as much as a small model's
        forward; a decode token (the common chunk) takes no range or generator at all."""
        if self.num_groups > 1:
            return self._prepare_groups(chunks)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        bs = self.block_size
        for chunk in chunks:
            seq, num_tokens, draft = chunk.seq, chunk.num_tokens, chunk.draft_token_ids
            start = seq.num_computed_tokens
            end = start + num_tokens + len(draft)
            table = seq.block_tables[0]
            if len(table) * bs < end:
                raise RuntimeError(f"{seq.request_id}: block table too short for {end} tokens")
            if end - start == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start : start + num_tokens])
                input_ids.extend(draft)
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(end - start)
            seq_lens.append(end)
            tables.append(table)
        width = max(map(len, tables))
        padded_tables = [t if len(t) == width else t + [0] * (width - len(t)) for t in tables]
        starts = list(accumulate(query_lens, initial=0))
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded_tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens_host=query_lens,
            seq_lens_host=seq_lens,
        )
        if self.sliding:
            meta.block_tables.clamp_(min=0)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta

    def _prepare_groups(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """`prepare` for a model with several KV groups: the same rows, and per group its own block
        tables and slot mapping (`AttentionMetadata.group_metas`); group 0's are the top level's."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        slots: list[list[int]] = [[] for _ in range(self.num_groups)]
        tables: list[list[list[int]]] = [[] for _ in range(self.num_groups)]
        bs = self.block_size
        for chunk in chunks:
            seq, draft = chunk.seq, chunk.draft_token_ids
            start = seq.num_computed_tokens
            num_tokens = chunk.num_tokens + len(draft)
            end = start + num_tokens
            if len(seq.block_tables) != self.num_groups or len(seq.block_tables[0]) * bs < end:
                raise RuntimeError(f"{seq.request_id}: block tables too short for {end} tokens")
            input_ids.extend(seq.token_ids[start : start + chunk.num_tokens])
            input_ids.extend(draft)
            positions.extend(range(start, end))
            for group, table in enumerate(seq.block_tables):
                # Every written position lies in a block the chunk's queries read, so none is NULL.
                slots[group].extend(table[p // bs] * bs + p % bs for p in range(start, end))
                tables[group].append(table)
            query_lens.append(num_tokens)
            seq_lens.append(end)
        width = max(map(len, tables[0]))
        dev = self.device
        shared = {
            "query_start_loc": torch.tensor(
                list(accumulate(query_lens, initial=0)), dtype=torch.int32, device=dev
            ),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            "query_lens_host": query_lens,
            "seq_lens_host": seq_lens,
        }
        metas = tuple(
            AttentionMetadata(
                block_tables=torch.tensor(
                    [[max(b, 0) for b in t] + [0] * (width - len(t)) for t in group_tables],
                    dtype=torch.int32,
                    device=dev,
                ),
                slot_mapping=torch.tensor(group_slots, dtype=torch.int64, device=dev),
                **shared,
            )
            for group_tables, group_slots in zip(tables, slots, strict=True)
        )
        meta = replace(metas[0], group_metas=metas)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run one forward; return the final hidden state of each chunk that completes its sequence,
        followed, for a chunk with a draft, by the hidden state after each draft token.

        The LM head is the caller's (`CausalLM.compute_logits` or `greedy_tokens`): an all-greedy step
        never needs the logits themselves.
        """
        input_ids, positions, meta = self.prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_cache, meta)
        last_rows: list[int] = []
        end = 0
        for chunk in chunks:
            end += chunk.num_tokens + len(chunk.draft_token_ids)
            if chunk.completes_sequence:
                last_rows.extend(range(end - 1 - len(chunk.draft_token_ids), end))
        return hidden[torch.tensor(last_rows, dtype=torch.long, device=self.device)]
