"""The paged KV pool's bookkeeping: which block holds which tokens, who references it, what may be evicted.

Nothing here touches tensors: a block is an index into the per-layer cache tensors. Exact accounting
(`num_free_blocks`, `refcount`) is what lets tests prove that no request ever leaks a block.

Automatic prefix caching: once a full block's KV is computed, it is registered under a chained hash —
SHA-256 of its parent block's hash and its token ids, the chain's root being the hash of the engine's
model/KV namespace and the request's cache salt. Equal hashes therefore mean equal salt, model and
all leading tokens; requests with different salts can never meet. A new sequence takes references to
the longest run of registered blocks matching its leading full blocks and computes only the rest
(never its last token, so there are logits to sample). A block whose last reference leaves keeps its
registration and joins an LRU of evictable blocks; allocation takes never-registered blocks first, then
evicts the least recently released. Evictable blocks count as free. A lookup also compares the block's
stored token ids and parent hash with the caller's, so even a hash collision cannot mix contents.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf

from base.errors import OutOfBlocksError
from engine.sequence import Sequence

BlockIdentity = tuple[bytes, tuple[int, ...]]


def root_hash(namespace: bytes, cache_salt: str) -> bytes:
    """The chain's parent for block 0: the model/KV namespace and the salt, unambiguously framed."""
    salt = cache_salt.encode()
    return hashlib.sha256(
        b"tandem-prefix/1" + len(namespace).to_bytes(4, "little") + namespace + salt
    ).digest()


def chain_hash(parent: bytes, token_ids: SequenceOf[int]) -> bytes:
    """The hash of a full block: its parent's hash and its token ids (fixed-width, so unambiguous)."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """A fixed pool of KV blocks with reference counts, a hash → block map and an LRU of evictable blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        namespace: bytes = b"",
        order: Iterable[int] | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.namespace = namespace
        self._free: deque[int] = deque(range(num_blocks) if order is None else order)
        if sorted(self._free) != list(range(num_blocks)):
            raise ValueError("order must be a permutation of range(num_blocks)")
        self._refcount = [0] * num_blocks
        self._identity: list[BlockIdentity | None] = [None] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # -- counting --------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-registered ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by live sequences, for the kv_cache_usage_perc metric."""
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks if self.num_blocks else 0.0

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- hashing and matching ----------------------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of `seq`'s first `num_blocks` full blocks, each computed once per sequence."""
        hashes, bs = seq.block_hashes, self.block_size
        parent = hashes[-1] if hashes else root_hash(self.namespace, seq.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes[:num_blocks]

    def _identity_of(self, seq: Sequence, index: int) -> BlockIdentity:
        parent = seq.block_hashes[index - 1] if index else root_hash(self.namespace, seq.cache_salt)
        return parent, tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Registered blocks holding `seq`'s leading full blocks (never its last token); no side effects."""
        if not self.enable_caching:
            return []
        hits = []
        for index, digest in enumerate(self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size)):
            block = self._cached.get(digest)
            if block is None or self._identity[block] != self._identity_of(seq, index):
                break
            hits.append(block)
        return hits

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` the cache would serve if it were admitted now."""
        return len(self.match_prefix(seq)) * self.block_size

    def prefix_hash(self, seq: Sequence, num_blocks: int) -> bytes:
        """The chain hash after `num_blocks` full blocks: what a tier holding them can prove it holds."""
        return (
            self.block_hashes(seq, num_blocks)[-1]
            if num_blocks
            else root_hash(self.namespace, seq.cache_salt)
        )

    # -- allocation --------------------------------------------------------------------------------------

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Free blocks `allocate(seq, num_tokens)` would consume: new blocks plus evictable cache hits."""
        if seq.block_table:
            return max(0, self.blocks_for_tokens(num_tokens) - len(seq.block_table))
        hits = self.match_prefix(seq)
        revived = sum(1 for block in hits if self._refcount[block] == 0)
        return max(0, self.blocks_for_tokens(num_tokens) - len(hits)) + revived

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give a sequence blocks for `num_tokens` tokens, all or nothing.

        A sequence without blocks first takes its cached prefix: those tokens count as computed and
        `seq.num_cached_tokens` records how many of its prompt tokens the cache served.
        """
        if self.blocks_needed(seq, num_tokens) > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {self.blocks_needed(seq, num_tokens)} KV blocks, "
                f"{self.num_free_blocks} free of {self.num_blocks}"
            )
        if not seq.block_table:
            hits = self.match_prefix(seq)
            for block in hits:
                self._reference(block)
            seq.block_table.extend(hits)
            seq.num_committed_blocks = len(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_computed_tokens
        self.grow(seq.block_table, num_tokens)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Extend `block_table` in place with fresh blocks so it holds `num_tokens` tokens; all or nothing."""
        missing = max(0, self.blocks_for_tokens(num_tokens) - len(block_table))
        if missing > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {missing} KV blocks, {self.num_free_blocks} free of {self.num_blocks}"
            )
        for _ in range(missing):
            block = self._free.popleft() if self._free else self._evict()
            self._refcount[block] = 1
            block_table.append(block)

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks_for_tokens(num_tokens) - len(block_table) <= self.num_free_blocks

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give `child` (no blocks yet, same leading tokens) references to `parent`'s full computed blocks.

        The child then computes only its tokens past them (its last token at least). This is how
        several samples of one prompt share its KV; it works with prefix caching off too.
        """
        if child.block_table:
            raise ValueError(f"{child.request_id} already holds blocks")
        shared = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        if child.token_ids[: shared * self.block_size] != parent.token_ids[: shared * self.block_size]:
            raise ValueError(f"{child.request_id} does not start with {parent.request_id}'s tokens")
        for block in parent.block_table[:shared]:
            self._reference(block)
        child.block_table.extend(parent.block_table[:shared])
        child.num_computed_tokens = shared * self.block_size
        child.num_committed_blocks = min(shared, parent.num_committed_blocks)

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks whose KV is now computed, so later requests can reuse them."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if not self.enable_caching or full <= seq.num_committed_blocks:
            return
        for index, digest in enumerate(
            self.block_hashes(seq, full)[seq.num_committed_blocks :], seq.num_committed_blocks
        ):
            block = seq.block_table[index]
            if digest not in self._cached and self._hash[block] is None:
                self._cached[digest] = block
                self._hash[block] = digest
                self._identity[block] = self._identity_of(seq, index)
        seq.num_committed_blocks = full

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, last block first (so a chain's tail is evicted before its head),
        and empty its table; a second call is harmless."""
        for block in reversed(seq.block_table):
            if self._refcount[block] <= 0:
                raise ValueError(f"block {block} freed twice")
            self._refcount[block] -= 1
            if self._refcount[block] == 0:
                if self._hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        seq.block_table.clear()
        seq.num_computed_tokens = seq.num_committed_blocks = 0

    def _reference(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._evictable[block]
        self._refcount[block] += 1

    def _evict(self) -> int:
        """Unregister the least recently released cached block and hand it out."""
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._hash[block]]
        self._hash[block] = self._identity[block] = None
        return block
