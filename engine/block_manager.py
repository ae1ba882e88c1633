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
With a recorder attached (`events`), registrations and evictions are recorded as KV events for
cache-aware routers (`engine.kv_events`); without one, nothing is.

KV groups (`engine.kv_layout`): a model whose layers attend differently keeps one block table per group,
all drawing from this one pool. A sliding-window group holds only the blocks a query can still read: the
entries below `first_kept_block` are `NULL_BLOCK`, and `release_slid_out` (run by the engine after every
step) drops the blocks that slide out. Prefix caching registers each group's full computed blocks under
the token chain's hash tagged with the group (so groups never share an entry), before a slid-out block
is released; a hit needs every full group's blocks for the whole prefix and each sliding group's blocks
for the last window before the hit point, the longest prefix where all agree (as vLLM's hybrid manager
finds it). One full-attention group (today's models) takes the same paths it always did.

Admission for chunked prefill (`admit`): a sliding group of a sequence whose prompt is computed in chunks
of at most `chunk_tokens` never holds more than the blocks one chunk plus its window touch, so a model
with several groups reserves that peak per sliding group (and the whole prompt in each full group, taken
at once) instead of the whole prompt everywhere. The sliding blocks are taken chunk by chunk from the
sequence's reservation, which `num_free_blocks` leaves out, so an admitted prompt never runs out of
blocks mid-way. A reservation counts the blocks the sequence *owns* (took from the pool and alone
references): a block it releases that another sequence still references gives nothing back to the pool,
so only owned blocks shrink what is reserved, and a prefix hit that takes a reference to an owned block
pays for it at its own admission. The reservation ends when the prompt is computed, or on free.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from base.errors import OutOfBlocksError
from engine.kv_events import KVEventRecorder
from engine.kv_layout import NULL_BLOCK, KVLayout, first_visible_block
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


@dataclass
class _Reservation:
    """The sliding-group blocks a sequence admitted for chunked prefill may hold at once (`claim`), and
    how many of them it owns now; the rest stays reserved until its `history` tokens are computed."""

    seq: Sequence
    history: int
    target: int
    claim: int
    owned: int = 0

    @property
    def left(self) -> int:
        return max(0, self.claim - self.owned)


class BlockManager:
    """A fixed pool of KV blocks with reference counts, a hash → block map and an LRU of evictable blocks,
    shared by the KV groups of `layout` (one full-attention group when None)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        namespace: bytes = b"",
        order: Iterable[int] | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.namespace = namespace
        self.windows: tuple[int | None, ...] = (
            tuple(group.window for group in layout.groups) if layout is not None else (None,)
        )
        self.num_groups = len(self.windows)
        # True when some group slides: tables then hold NULL_BLOCK entries and blocks leave them early.
        self.sliding = any(window is not None for window in self.windows)
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
        # Chunked-prefill admissions of multi-group layouts, by id(seq); the blocks they own; the blocks
        # still reserved for them (kept out of `num_free_blocks`).
        self._reservations: dict[int, _Reservation] = {}
        self._owner: dict[int, int] = {}
        self._num_reserved = 0
        # Where registrations and evictions are recorded as KV events (`engine.kv_events`); None: nowhere.
        self.events: KVEventRecorder | None = None

    # -- counting --------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-registered ones plus evictable cached ones, less the ones
        reserved for prompts admitted by `admit`."""
        return len(self._free) + len(self._evictable) - self._num_reserved

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

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks `seq`'s tables reference, over all groups (NULL entries hold none)."""
        return sum(len(table) - table.count(NULL_BLOCK) for table in seq.block_tables)

    def first_kept_block(self, group: int, num_computed_tokens: int) -> int:
        """The first logical block group `group` keeps for a sequence with `num_computed_tokens` computed.

        What a query at the last computed position can read, not only the next one: a fork's choice and
        a constrained request after a remote prefill compute that position again."""
        return first_visible_block(max(num_computed_tokens - 1, 0), self.windows[group], self.block_size)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """`seq`'s tables, one per group (a new sequence comes with a single empty one)."""
        tables = seq.block_tables
        if len(tables) != self.num_groups:
            if any(tables):
                raise ValueError(f"{seq.request_id} holds tables of another KV layout")
            tables[:] = [[] for _ in range(self.num_groups)]
        return tables

    # -- hashing and matching ----------------------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of `seq`'s first `num_blocks` full blocks, each computed once per sequence."""
        hashes, bs = seq.block_hashes, self.block_size
        parent = hashes[-1] if hashes else root_hash(self.namespace, seq.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = chain_hash(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes[:num_blocks]

    @staticmethod
    def _key(group: int, digest: bytes) -> bytes:
        """The cache key of a group's block: the token chain's hash, tagged past group 0 (a longer key,
        so no group's key can equal another's)."""
        return digest + group.to_bytes(2, "little") if group else digest

    @staticmethod
    def _split_key(key: bytes) -> tuple[int, bytes]:
        """The group and token-chain hash a cache key (`_key`) was made of."""
        return int.from_bytes(key[32:], "little"), key[:32]

    def _identity_of(self, seq: Sequence, index: int) -> BlockIdentity:
        parent = seq.block_hashes[index - 1] if index else root_hash(self.namespace, seq.cache_salt)
        return parent, tuple(seq.token_ids[index * self.block_size : (index + 1) * self.block_size])

    def _hit(self, seq: Sequence, group: int, index: int, digest: bytes) -> int | None:
        block = self._cached.get(self._key(group, digest))
        if block is None or self._identity[block] != self._identity_of(seq, index):
            return None
        return block

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Group 0's registered blocks holding `seq`'s leading full blocks (never its last token)."""
        return self.match_prefix_groups(seq)[0]

    def match_prefix_groups(self, seq: Sequence) -> list[list[int]]:
        """Per group, the registered blocks a new `seq` can start from; no side effects.

        The hit point is the longest run of leading full blocks (never the last token) for which every
        full group has all blocks and every sliding group those a query at the hit point can read; a
        sliding group's entries below them are NULL_BLOCK."""
        if not self.enable_caching:
            return [[] for _ in range(self.num_groups)]
        hashes = self.block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        if not self.sliding:
            hits = []
            for index, digest in enumerate(hashes):
                block = self._hit(seq, 0, index, digest)
                if block is None:
                    break
                hits.append(block)
            return [hits]  # without a sliding group there is one group
        found = [[self._hit(seq, g, i, d) for i, d in enumerate(hashes)] for g in range(self.num_groups)]
        length = len(hashes)
        while True:  # shrink until every group agrees: each one's answer only shrinks the others'
            agreed = length
            for group, blocks in enumerate(found):
                length = self._longest_hit(group, blocks, length)
            if length == agreed:
                break
        tables = []
        for group, blocks in enumerate(found):
            first = self.first_kept_block(group, length * self.block_size) if length else 0
            tables.append([NULL_BLOCK] * first + blocks[first:length])
        return tables

    def _longest_hit(self, group: int, blocks: list[int | None], limit: int) -> int:
        """The largest hit point m <= limit (in blocks) with group `group`'s needed blocks all found."""
        window = self.windows[group]
        if window is None:
            for index in range(limit):
                if blocks[index] is None:
                    return index
            return limit
        # A hit point m needs blocks first_kept(m) .. m-1: all of them while m * bs <= window, then the
        # last ceil(window / bs). Scan down from the limit for the first run that long.
        span = -(-window // self.block_size)
        run = 0
        for index in range(limit - 1, -1, -1):
            run = run + 1 if blocks[index] is not None else 0
            if run == span:
                return index + span
        return run

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq` the cache would serve if it were admitted now."""
        return len(self.match_prefix_groups(seq)[0]) * self.block_size

    def prefix_hash(self, seq: Sequence, num_blocks: int) -> bytes:
        """The chain hash after `num_blocks` full blocks: what a tier holding them can prove it holds."""
        return (
            self.block_hashes(seq, num_blocks)[-1]
            if num_blocks
            else root_hash(self.namespace, seq.cache_salt)
        )

    # -- allocation --------------------------------------------------------------------------------------

    def _new_entries(self, table_len: int, target: int, group: int, reads_from: int | None) -> int:
        """Blocks a table of `table_len` entries takes to reach `target`: those at or past the first block
        a query at `reads_from` reads (every one when None)."""
        if reads_from is None:
            return max(0, target - table_len)
        first = first_visible_block(reads_from, self.windows[group], self.block_size)
        return max(0, target - max(table_len, first))

    def blocks_needed(self, seq: Sequence, num_tokens: int, reads_from: int | None = None) -> int:
        """Free blocks `allocate(seq, num_tokens, reads_from)` would consume: new blocks plus evictable
        cache hits, over all groups."""
        target = self.blocks_for_tokens(num_tokens)
        tables = seq.block_tables
        if tables[0]:
            return sum(
                self._new_entries(len(table), target, group, reads_from) for group, table in enumerate(tables)
            )
        needed = 0
        for group, hits in enumerate(self.match_prefix_groups(seq)):
            needed += self._new_entries(len(hits), target, group, reads_from)
            needed += sum(1 for block in hits if block != NULL_BLOCK and self._refcount[block] == 0)
        return needed

    def can_allocate(self, seq: Sequence, num_tokens: int, reads_from: int | None = None) -> bool:
        return self.blocks_needed(seq, num_tokens, reads_from) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_tokens: int, reads_from: int | None = None) -> None:
        """Give a sequence blocks for `num_tokens` tokens in every group, all or nothing.

        A sequence without blocks first takes its cached prefix: those tokens count as computed and
        `seq.num_cached_tokens` records how many of its prompt tokens the cache served. `reads_from` is
        for a sequence whose KV up to there arrives from elsewhere (a remote prefill): the first position
        this replica will run a query at, so a sliding group gets no block such a query cannot read.
        """
        if self.num_groups == 1 and reads_from is None and seq.block_tables[0]:
            self.grow(seq.block_tables[0], num_tokens)  # a decode's growth: one table, nothing to match
            return
        if self._reservations and reads_from is None:
            reservation = self._reservations.get(id(seq))
            if reservation is not None:
                self._take_reserved(reservation, num_tokens)
                return
        needed = self.blocks_needed(seq, num_tokens, reads_from)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {needed} KV blocks, {self.num_free_blocks} free of {self.num_blocks}"
            )
        tables = self._tables(seq)
        if not tables[0]:
            self._take_prefix(seq, tables, self.match_prefix_groups(seq))
        self._extend(tables, num_tokens, reads_from)
        if reads_from is not None and self.sliding:
            self._release_below(tables, reads_from + 1)

    def _take_prefix(self, seq: Sequence, tables: list[list[int]], hits: list[list[int]]) -> None:
        """Reference the cached blocks a new sequence starts from; its cached tokens count as computed."""
        for table, blocks in zip(tables, hits, strict=True):
            for block in blocks:
                if block != NULL_BLOCK:
                    self._reference(block)
            table.extend(blocks)
        hit_blocks = len(tables[0])
        seq.num_committed_blocks = hit_blocks
        seq.num_computed_tokens = hit_blocks * self.block_size
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens

    def catch_up_prefix(self, seq: Sequence) -> int:
        """Take the cached blocks other sequences registered since `seq` was admitted, while `seq` has
        computed nothing of its own; returns the tokens it now need not compute.

        Prompts admitted together match the cache before any of them has run, so a prefix they share
        would be computed by each; caught up just before its first chunk, a prompt reuses what the ones
        ahead of it computed. The blocks it had for those positions were never written and go back to
        the pool. One-group layouts only (a sliding group's reservation holds its peak, not its blocks).
        On a sliding one-group layout the hit's entries below its last window are NULL_BLOCK: the blocks
        `seq` held there, its own earlier hits included, leave its table as they would have slid out.
        """
        if self.num_groups != 1 or not self.enable_caching:
            return 0
        start = seq.num_committed_blocks
        if (
            seq.num_computed_tokens != start * self.block_size
            or seq.num_computed_tokens != seq.num_cached_tokens
        ):
            return 0
        hits = self.match_prefix(seq)
        if len(hits) <= start:
            return 0
        table = seq.block_tables[0]
        for index, block in enumerate(hits):
            if table[index] == block:
                continue
            if block != NULL_BLOCK:
                self._reference(block)
            if table[index] != NULL_BLOCK:
                self._unreference(table[index])
            table[index] = block
        gained = (len(hits) - start) * self.block_size
        seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens += gained
        seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        self.num_hit_tokens += gained
        return gained

    # -- admission for chunked prefill: reserve each sliding group's peak --------------------------------

    def _reserves_peak(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `admit` reserves peaks: several groups, one sliding, a new sequence, and at most the
        one-token margin past its history (a reservation for more tokens than that is not a prefill's)."""
        return (
            self.num_groups > 1
            and self.sliding
            and not seq.block_tables[0]
            and 0 <= num_tokens - seq.num_tokens <= 1
        )

    def _admission_plan(
        self, seq: Sequence, num_tokens: int, chunk_tokens: int
    ) -> tuple[int, list[list[int]], int]:
        """Free blocks `admit` consumes, the prefix hits it takes, and its sliding groups' claim.

        A sliding group's table spans, while a chunk of `take` tokens past `computed` runs, the blocks from
        the first one a query at computed - 1 reads to the one holding token computed + take + margin: at
        most ceil((block_size - 1 + window + chunk_tokens + margin) / block_size), and never more than the
        whole prompt past its first kept block."""
        hits = self.match_prefix_groups(seq)
        target = self.blocks_for_tokens(num_tokens)
        margin = num_tokens - seq.num_tokens
        cost = claim = 0
        for group, blocks in enumerate(hits):
            window = self.windows[group]
            held = [block for block in blocks if block != NULL_BLOCK]
            # A hit on a block a reservation owns moves it off that reservation: this admission pays.
            cost += sum(1 for block in held if block in self._owner)
            if window is None:
                cost += target - len(blocks) + sum(1 for block in held if self._refcount[block] == 0)
            else:
                span = -(-(self.block_size - 1 + window + chunk_tokens + margin) // self.block_size)
                claim += min(target - (len(blocks) - len(held)), span)
        return cost + claim, hits, claim

    def admission_blocks(self, seq: Sequence, num_tokens: int, chunk_tokens: int) -> int:
        """Free blocks `admit(seq, num_tokens, chunk_tokens)` would consume (reserved ones included)."""
        if not self._reserves_peak(seq, num_tokens):
            return self.blocks_needed(seq, num_tokens)
        return self._admission_plan(seq, num_tokens, chunk_tokens)[0]

    def can_admit(self, seq: Sequence, num_tokens: int, chunk_tokens: int) -> bool:
        return self.admission_blocks(seq, num_tokens, chunk_tokens) <= self.num_free_blocks

    def admit(self, seq: Sequence, num_tokens: int, chunk_tokens: int) -> None:
        """Admit a new sequence whose history is then computed in chunks of at most `chunk_tokens` tokens,
        each grown with `allocate(seq, computed + chunk [+ 1])`, up to `num_tokens` (its history, or one
        more); all or nothing.

        Full groups get every block at once; sliding groups their prefix hits and first chunk, the rest of
        their peak reserved. One-group layouts (and anything else `_reserves_peak` refuses) allocate
        everything as `allocate` does."""
        if not self._reserves_peak(seq, num_tokens):
            self.allocate(seq, num_tokens)
            return
        needed, hits, claim = self._admission_plan(seq, num_tokens, chunk_tokens)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {needed} KV blocks, {self.num_free_blocks} free of {self.num_blocks}"
            )
        reservation = _Reservation(seq, seq.num_tokens, num_tokens, claim)
        self._reservations[id(seq)] = reservation
        self._num_reserved += claim
        tables = self._tables(seq)
        self._take_prefix(seq, tables, hits)
        for group, table in enumerate(tables):
            # A sliding hit revived from the evictable LRU came out of the pool: the reservation owns it.
            if self.windows[group] is not None:
                for block in table:
                    if block != NULL_BLOCK and self._refcount[block] == 1:
                        self._own(reservation, block)
        self._take_reserved(reservation, min(num_tokens, seq.num_computed_tokens + chunk_tokens), full=True)

    def _take_reserved(self, reservation: _Reservation, num_tokens: int, full: bool = False) -> None:
        """Grow a reserved sequence's sliding tables (and, with `full`, its full ones to the whole target)
        to hold `num_tokens` tokens, sliding blocks first from its reservation; the chunk that ends the
        history grows every table to the admission's target, so all of them end equally long."""
        seq = reservation.seq
        if num_tokens >= reservation.history:
            num_tokens = max(num_tokens, reservation.target)
        wanted = [
            self.blocks_for_tokens(reservation.target if full and window is None else num_tokens)
            for window in self.windows
        ]
        tables = seq.block_tables
        sliding = from_pool = 0
        for group, table in enumerate(tables):
            missing = max(0, wanted[group] - len(table))
            if self.windows[group] is None:
                from_pool += missing
            else:
                sliding += missing
        from_pool += max(0, sliding - reservation.left)
        if from_pool > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {from_pool} KV blocks, {self.num_free_blocks} free of {self.num_blocks}"
            )
        for group, table in enumerate(tables):
            for _ in range(wanted[group] - len(table)):
                block = self._free.popleft() if self._free else self._evict()
                self._refcount[block] = 1
                table.append(block)
                if self.windows[group] is not None:
                    self._own(reservation, block)

    def _own(self, reservation: _Reservation, block: int) -> None:
        self._owner[block] = id(reservation.seq)
        self._count_owned(reservation, 1)

    def _disown(self, block: int) -> None:
        """`block` leaves its reservation: freed, or referenced by another sequence too."""
        key = self._owner.pop(block, None)
        if key is not None:
            self._count_owned(self._reservations[key], -1)

    def _count_owned(self, reservation: _Reservation, delta: int) -> None:
        left = reservation.left
        reservation.owned += delta
        self._num_reserved += reservation.left - left

    def _end_reservation(self, seq: Sequence) -> None:
        """Give back what `seq`'s reservation still holds back; its blocks become ordinary ones."""
        reservation = self._reservations.pop(id(seq), None)
        if reservation is None:
            return
        self._num_reserved -= reservation.left
        key = id(seq)
        for table in seq.block_tables:
            for block in table:
                if block != NULL_BLOCK and self._owner.get(block) == key:
                    del self._owner[block]

    def _extend(self, tables: list[list[int]], num_tokens: int, reads_from: int | None = None) -> None:
        """Grow every group's table to hold `num_tokens` tokens; the caller checked the free count."""
        target = self.blocks_for_tokens(num_tokens)
        for group, table in enumerate(tables):
            if reads_from is not None and len(table) < target:
                first = first_visible_block(reads_from, self.windows[group], self.block_size)
                table.extend([NULL_BLOCK] * (min(first, target) - len(table)))
            self.grow(table, num_tokens)

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

    def extend(self, seq: Sequence, num_tokens: int) -> None:
        """Grow each of `seq`'s tables to hold `num_tokens` tokens (no prefix matching); all or nothing."""
        tables = self._tables(seq)
        target = self.blocks_for_tokens(num_tokens)
        needed = sum(max(0, target - len(table)) for table in tables)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"need {needed} KV blocks, {self.num_free_blocks} free of {self.num_blocks}"
            )
        self._extend(tables, num_tokens)

    def fork(self, parent: Sequence, child: Sequence, reads_from: int | None = None) -> None:
        """Give `child` (no blocks yet, same leading tokens) references to `parent`'s full computed blocks.

        The child then computes only its tokens past them (its last token at least), its first query at
        `reads_from` (default: right past the shared blocks), so a sliding group shares only what that
        query can read. This is how several samples of one prompt share its KV; it works with prefix
        caching off too.
        """
        if child.block_tables[0]:
            raise ValueError(f"{child.request_id} already holds blocks")
        shared = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        if child.token_ids[: shared * self.block_size] != parent.token_ids[: shared * self.block_size]:
            raise ValueError(f"{child.request_id} does not start with {parent.request_id}'s tokens")
        start = shared * self.block_size if reads_from is None else reads_from
        tables = self._tables(child)
        picked = []
        for group, table in enumerate(parent.block_tables):
            first = min(first_visible_block(start, self.windows[group], self.block_size), shared)
            blocks = table[first:shared]
            if NULL_BLOCK in blocks:
                raise ValueError(f"{parent.request_id}'s blocks a fork would read have slid out")
            picked.append([NULL_BLOCK] * first + blocks)
        for table, blocks in zip(tables, picked, strict=True):
            for block in blocks:
                if block != NULL_BLOCK:
                    self._reference(block)
            table.extend(blocks)
        child.num_computed_tokens = shared * self.block_size
        child.num_committed_blocks = min(shared, parent.num_committed_blocks)

    def commit(self, seq: Sequence) -> None:
        """Register the full blocks whose KV is now computed (every group's), so later requests can reuse
        them; a sliding group's block is registered before it can slide out."""
        tables = seq.block_tables
        full = min(seq.num_computed_tokens // self.block_size, len(tables[0]))
        if not self.enable_caching or full <= seq.num_committed_blocks:
            return
        hashes = self.block_hashes(seq, full)
        # Per group, the blocks registered now, when someone records events.
        registered: list[list[int]] | None = [[] for _ in tables] if self.events is not None else None
        for index, digest in enumerate(hashes[seq.num_committed_blocks :], seq.num_committed_blocks):
            identity = None
            for group, table in enumerate(tables):
                block = table[index]
                if block == NULL_BLOCK:
                    continue
                key = self._key(group, digest)
                if key not in self._cached and self._hash[block] is None:
                    self._cached[key] = block
                    self._hash[block] = key
                    self._identity[block] = identity = identity or self._identity_of(seq, index)
                    if registered is not None:
                        registered[group].append(index)
        seq.num_committed_blocks = full
        if registered is not None:
            for group, indices in enumerate(registered):
                if indices:
                    self.events.stored(group, indices, hashes, seq.token_ids)

    def release_slid_out(self, seq: Sequence) -> None:
        """Drop every sliding-group block of `seq` that no query it will run can read any more.

        Commit first: a full block released here stays cached (evictable) for later prefix hits. A
        reservation whose history is now computed ends here."""
        self._release_below(seq.block_tables, seq.num_computed_tokens)
        if self._reservations:
            reservation = self._reservations.get(id(seq))
            if reservation is not None and seq.num_computed_tokens >= reservation.history:
                self._end_reservation(seq)

    def release_unread(self, seq: Sequence, reads_from: int) -> None:
        """Drop the sliding-group blocks no query at `reads_from` or later reads: what `allocate` with
        `reads_from` would not have taken, for a sequence sent to a remote prefill after its blocks were
        reserved (its KV up to `reads_from` arrives from there). A sequence admitted by `admit` then takes,
        from its reservation, the blocks of the last window that KV lands in, and its reservation ends."""
        tables = seq.block_tables
        self._release_below(tables, reads_from + 1)
        reservation = self._reservations.get(id(seq)) if self._reservations else None
        if reservation is None:
            return
        target = self.blocks_for_tokens(reservation.target)
        for group, table in enumerate(tables):
            first = first_visible_block(reads_from, self.windows[group], self.block_size)
            table.extend([NULL_BLOCK] * (min(first, target) - len(table)))
        self._take_reserved(reservation, reservation.target)
        self._end_reservation(seq)

    def _release_below(self, tables: list[list[int]], num_computed_tokens: int) -> None:
        for group, table in enumerate(tables):
            if self.windows[group] is None:
                continue
            # Tables are a NULL_BLOCK run then held blocks: walk down from the boundary to the run.
            index = min(self.first_kept_block(group, num_computed_tokens), len(table)) - 1
            while index >= 0 and table[index] != NULL_BLOCK:
                self._unreference(table[index])
                table[index] = NULL_BLOCK
                index -= 1

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references, last block first (so a chain's tail is evicted before its head),
        and empty its tables (ending its reservation); a second call is harmless."""
        if self._reservations:
            self._end_reservation(seq)
        for table in reversed(seq.block_tables):
            for block in reversed(table):
                if block != NULL_BLOCK:
                    self._unreference(block)
            table.clear()
        seq.num_computed_tokens = seq.num_committed_blocks = 0

    def _unreference(self, block: int) -> None:
        if self._refcount[block] <= 0:
            raise ValueError(f"block {block} freed twice")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if self._owner:
                self._disown(block)
            if self._hash[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    def _reference(self, block: int) -> None:
        if self._refcount[block] == 0:
            del self._evictable[block]
        elif self._owner:
            self._disown(block)  # shared now: its owner's release would give nothing back to the pool
        self._refcount[block] += 1

    def _evict(self) -> int:
        """Unregister the least recently released cached block and hand it out."""
        block, _ = self._evictable.popitem(last=False)
        key = self._hash[block]
        del self._cached[key]
        if self.events is not None:
            self.events.removed(*self._split_key(key))
        self._hash[block] = self._identity[block] = None
        return block
