"""Plain torch implementations of every kernel: the definition of truth for tests and the CPU path.

They favour obviousness over speed except where the CPU path needs it (the batched decode
gather), and even there each step is a readable tensor operation.
"""

from __future__ import annotations

import torch

from base.kv_dtypes import SCALE_DTYPE, quant_max
from kernels.metadata import AttentionMetadata
from kernels.window import first_visible, kernel_window


def quantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows `[..., head_dim]` as `dtype` elements and one fp32 scale per row (`kernels.kv_quant`).

    scale = max|row| / QMAX and stored = row / scale, rounded half to even for int8 (fp8's cast rounds
    to nearest even itself), clamped to ±QMAX; an all-zero row gets scale 0 and zeros. Both divisions
    are IEEE-rounded on every device: QMAX is a tensor on the rows' device (filled there, no host copy),
    because CUDA torch divides by a Python number as a multiply by its rounded reciprocal, a bit off in
    some rows.
    """
    x = rows.float()
    qmax = torch.full((), float(quant_max(dtype)), device=x.device)
    scale = x.abs().amax(dim=-1) / qmax
    scaled = (x / torch.where(scale > 0, scale, 1.0).unsqueeze(-1)).clamp(-qmax, qmax)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype), scale.to(SCALE_DTYPE)


def dequantize_kv(stored: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 rows from stored elements `[..., head_dim]` and their scales `[...]`."""
    return stored.float() * scales.unsqueeze(-1)


def _index_copy_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache.view(slots, ...)[slots] = rows, through bytes for dtypes whose index_copy_ torch lacks (fp8)."""
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    if cache.dtype.itemsize == 1:
        flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
    flat.index_copy_(0, slots, rows)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Store new K/V rows `[T, kv_heads, head_dim]` at their flat slots; slot -1 rows are skipped.

    With scale caches `[blocks, block_size, kv_heads]` (a quantized cache) each (token, head) row is
    quantized to the cache's dtype and its scale stored beside it.
    """
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    for rows, cache, scales in ((key, k_cache, k_scales), (value, v_cache, v_scales)):
        if scales is None:
            _index_copy_rows(cache, slot_mapping, rows.to(cache.dtype))
            continue
        stored, row_scales = quantize_kv(rows, cache.dtype)
        _index_copy_rows(cache, slot_mapping, stored)
        _index_copy_rows(scales, slot_mapping, row_scales)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Copy whole blocks out of the cache, `[len(block_ids), block_size, kv_heads, head_dim]`.

    Selecting rows of a 2-D view copies each block with one memcpy; indexing the 4-D tensor
    directly goes element by element, several times slower on the CPU.
    """
    rows = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1).long())
    return rows.view(-1, *cache.shape[1:])


def gather_dequantized(
    cache: torch.Tensor, block_ids: torch.Tensor, scales: torch.Tensor | None
) -> torch.Tensor:
    """`gather_blocks`, as fp32 values when the cache is quantized (`scales` given), else as stored."""
    blocks = gather_blocks(cache, block_ids)
    if scales is None:
        return blocks
    return dequantize_kv(blocks, gather_blocks(scales, block_ids))


def gather_context(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scales: torch.Tensor | None = None,
    first_block: int = 0,
) -> torch.Tensor:
    """The cached rows of one sequence from block `first_block` up to position `seq_len`,
    `[seq_len - first_block * block_size, kv_heads, head_dim]` (dequantized to fp32 when `scales` are
    given). Blocks before `first_block` are never read: under a sliding window they may be garbage."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = gather_dequantized(cache, block_table[first_block:num_blocks], scales)
    return blocks.reshape(-1, cache.shape[2], cache.shape[3])[: seq_len - first_block * block_size]


def attend_one_sequence(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """Causal attention of the last q_len positions over a context, GQA without repeating KV.

    query `[q_len, heads, d]`, key/value `[ctx, kv_heads, d]`: the context's last ctx positions (a
    windowed caller may leave out a prefix no query sees). Query heads are grouped under their KV head
    so each group is one matmul against that head's keys. With a `window`, the query at position p sees
    keys p - window < j <= p.
    """
    q_len, num_heads, head_dim = query.shape
    ctx_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    q = query.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).float()
    k = key.permute(1, 0, 2).float()
    v = value.permute(1, 0, 2).float()
    scores = torch.matmul(q, k.unsqueeze(1).transpose(-1, -2)) * scale  # [kvh, g, q_len, ctx]
    query_pos = torch.arange(ctx_len - q_len, ctx_len, device=query.device).unsqueeze(1)
    key_pos = torch.arange(ctx_len, device=query.device).unsqueeze(0)
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.unsqueeze(1))  # [kvh, g, q_len, d]
    return out.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(query.dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Reference attention for a mixed batch, one sequence at a time. query `[T, heads, d]`; the scale
    caches are given for a quantized cache; `window` (None: full attention) is a sliding window, and a
    sequence's blocks below every one of its queries' windows are not read."""
    kernel_window(window)
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host, strict=False)):
        rows = slice(start, start + q_len)
        start += q_len
        first_block = first_visible(seq_len, q_len, window) // block_size
        key = gather_context(k_cache, meta.block_tables[i], seq_len, k_scales, first_block)
        value = gather_context(v_cache, meta.block_tables[i], seq_len, v_scales, first_block)
        out[rows] = attend_one_sequence(query[rows], key, value, scale, window)
    return out


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Batched decode attention: one query token per sequence, all sequences in one gather.

    query `[B, heads, d]`; block_tables `[B, max_blocks]`; seq_lens `[B]`; `window` (None: full
    attention) a sliding window. Each sequence gathers the same number of blocks from its first
    visible one, the most any sequence of the batch needs; a shorter one repeats its last block in
    the padding (masked), so no block outside a sequence's visible range (garbage under a window, or
    a table's padding) is ever read. On a CPU this beats a Python loop. Each KV head is one batched
    matmul over a strided view of the gathered blocks, so the gathered K and V are never permuted
    into another copy.
    """
    kernel_window(window)
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    lens = seq_lens.to(torch.long).unsqueeze(1)  # [B, 1]
    lowest = torch.zeros_like(lens) if window is None else (lens - window).clamp(min=0)
    first_block = lowest // block_size
    last_block = (lens - 1).clamp(min=0) // block_size
    num_blocks = int((last_block - first_block).max()) + 1
    span = num_blocks * block_size
    index = torch.minimum(first_block + torch.arange(num_blocks, device=lens.device), last_block)
    table = block_tables.gather(1, index)
    k = gather_dequantized(k_cache, table, k_scales).view(batch, span, num_kv_heads, head_dim).float()
    v = gather_dequantized(v_cache, table, v_scales).view(batch, span, num_kv_heads, head_dim).float()
    q = query.view(batch, num_kv_heads, group, head_dim).float()
    positions = first_block * block_size + torch.arange(span, device=lens.device)  # [B, S]
    padding = ((positions >= lens) | (positions < lowest)).unsqueeze(1)  # [B, 1, S]
    out = torch.empty(batch, num_kv_heads, group, head_dim, device=query.device)
    for head in range(num_kv_heads):
        scores = torch.bmm(q[:, head], k[:, :, head].transpose(1, 2)) * scale  # [B, g, S]
        scores.masked_fill_(padding, float("-inf"))
        out[:, head] = torch.bmm(torch.softmax(scores, dim=-1), v[:, :, head])
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def decode_attention_partials(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    split_size: int,
    num_splits: int,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """First stage of split-KV decode, written plainly: per split of `split_size` context tokens,
    the softmax-normalised output and the natural-log sum-exp of its scores.

    Splits start at the sequence's first visible key (position 0, or under a `window` the first one
    inside it). Returns `partial [B, heads, num_splits, d]` and `lse [B, heads, num_splits]` in fp32;
    a split past the end of its sequence has output 0 and lse -inf (it carries no weight in the merge).
    """
    kernel_window(window)
    batch, num_heads, head_dim = query.shape
    block_size = k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    partial = torch.zeros((batch, num_heads, num_splits, head_dim), device=query.device)
    lse = torch.full((batch, num_heads, num_splits), float("-inf"), device=query.device)
    for i in range(batch):
        seq_len = int(seq_lens[i])
        lowest = first_visible(seq_len, 1, window)
        first_block = lowest // block_size
        key = gather_context(k_cache, block_tables[i], seq_len, k_scales, first_block).float()
        value = gather_context(v_cache, block_tables[i], seq_len, v_scales, first_block).float()
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        skipped = lowest - first_block * block_size  # rows of the first block below the window
        for split in range(num_splits):
            span = slice(skipped + split * split_size, min(skipped + (split + 1) * split_size, len(key)))
            if span.start >= len(key):
                break
            scores = torch.einsum("hd,nhd->hn", query[i].float(), key[span]) * scale
            lse[i, :, split] = torch.logsumexp(scores, dim=-1)
            partial[i, :, split] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), value[span])
    return partial, lse


def merge_attention_partials(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Second stage of split-KV decode: the splits' outputs weighted by softmax over their lse.

    `partial [B, heads, S, d]`, `lse [B, heads, S]` -> `[B, heads, d]` fp32. A row whose splits
    all have lse -inf (an empty sequence) merges to zeros.
    """
    empty = torch.isneginf(lse).all(dim=-1, keepdim=True)
    weights = torch.softmax(lse.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return (weights.unsqueeze(-1) * partial.float()).sum(dim=-2)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional residual add first; returns (normed, new residual).

    Computed exactly as Hugging Face Llama does (fp32 statistics, weight applied after casting
    back) so greedy decoding matches it token for token.
    """
    if residual is not None:
        x = x + residual
    residual = x
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed, residual


def apply_rope(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE on q `[T, heads, d]` and k `[T, kv_heads, d]` with cos/sin `[T, d]`."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: silu(gate) * up, with gate and up concatenated on the last dim."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
