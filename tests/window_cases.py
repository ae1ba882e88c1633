"""Sliding-window test cases every attention kernel's tests share: a plain per-row definition of windowed
attention to check against, and caches whose blocks below every query's window are garbage, as a block
freed from a local KV group and reused by another sequence (or a table entry reset to 0) leaves them."""

from __future__ import annotations

import torch

from kernels import torch_reference as ref
from kernels.metadata import AttentionMetadata
from kernels.window import first_visible


def windowed_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention written out row by row: the query at position p attends to keys p - window < j <= p."""
    out = torch.empty(query.shape, dtype=torch.float32)
    group = query.shape[1] // k_cache.shape[2]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        key = ref.gather_context(k_cache, meta.block_tables[i], seq_len, k_scales).float()
        value = ref.gather_context(v_cache, meta.block_tables[i], seq_len, v_scales).float()
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        for row in range(q_len):
            pos = seq_len - q_len + row
            lowest = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,nhd->hn", query[start + row].float(), key[lowest : pos + 1]) * scale
            out[start + row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), value[lowest : pos + 1])
        start += q_len
    return out


def hidden_blocks(meta: AttentionMetadata, block_size: int, window: int) -> list[tuple[int, int]]:
    """(sequence, table column) of every block wholly below all of its sequence's queries' windows."""
    hidden = []
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=True)):
        hidden += [(i, column) for column in range(first_visible(seq_len, q_len, window) // block_size)]
    return hidden


def poison_hidden_blocks(
    caches: tuple[torch.Tensor, ...], meta: AttentionMetadata, window: int
) -> tuple[tuple[torch.Tensor, ...], AttentionMetadata]:
    """Copies of `caches` (K, V, and a quantized cache's scales) and `meta` in which every block below
    the window holds NaN (its scales too), and half of their table entries point to one more block,
    all NaN, the other half to block 0 (as a freed entry reset to 0 reads; block 0 itself is left clean
    only when no sequence hides it)."""
    block_size = caches[0].shape[1]
    poisoned = [torch.cat([cache, torch.zeros_like(cache[:1])]) for cache in caches]
    tables = meta.block_tables.clone()
    spare = caches[0].shape[0]
    hidden = [int(tables[seq, column]) for seq, column in hidden_blocks(meta, block_size, window)]
    for cache in poisoned:
        if cache.is_floating_point():  # int8 elements cannot be NaN; their scales are
            cache[[*hidden, spare]] = float("nan")
    for n, (seq, column) in enumerate(hidden_blocks(meta, block_size, window)):
        tables[seq, column] = spare if n % 2 == 0 else 0
    return tuple(poisoned), AttentionMetadata(
        query_start_loc=meta.query_start_loc,
        seq_lens=meta.seq_lens,
        block_tables=tables,
        slot_mapping=meta.slot_mapping,
        query_lens_host=meta.query_lens_host,
        seq_lens_host=meta.seq_lens_host,
    )
