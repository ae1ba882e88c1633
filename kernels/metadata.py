"""Per-step attention metadata for a mixed batch of prefill chunks and decode tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes where each sequence's new tokens sit in the flat token batch and in the paged cache.

    Tokens of all sequences are concatenated into one flat batch of T rows. Sequence i owns rows
    `query_start_loc[i]:query_start_loc[i+1]`; those are its *last* query_len positions, so its
    context (cached prefix plus the new tokens) has `seq_lens[i]` tokens whose KV lives in the
    blocks `block_tables[i]`. The host-side lists mirror the device tensors so the CPU path and
    kernel launch code never synchronise with the device to read them.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, -1 marks a padding row that writes nothing
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # A model with several KV groups (`engine.kv_layout`): each group's metadata, whose block tables and
    # slot mapping are that group's (the rest is shared). Empty when the model has one group.
    group_metas: tuple[AttentionMetadata, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV group `group` attends with."""
        return self.group_metas[group] if self.group_metas else self

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
