"""KV block bookkeeping: ids, ref counts, prefix hashes and the LRU of cached free blocks.

Never touches device memory. Block 0 is reserved (padding entries of block tables point at it),
so real data never lives there. A block is *sealed* once all its tokens' K/V are computed: it then
carries hash(prev_hash, tokens) and can be shared by later requests with the same prefix. A sealed
block whose ref count drops to 0 stays cached in an LRU until a fresh block is needed.

A prompt's last, partial block (the tokens after its last whole block and before its last token) may
also be cached, as a *partial* entry hash(prev_hash, those tokens): a later request with the same
prompt copies that block (its own is written past them) and computes only the last token. A block
can hold both entries (its partial prompt tail, and once full, the whole block).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

NO_HASH = None


def block_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    return hash((prev_hash, tuple(token_ids)))


class PrefixChain:
    """The full blocks of a token sequence (as tuples) and their chained hashes, made once: a long prompt
    is matched against the GPU cache, then the host tier, and its blocks sealed, from the same hashes
    (for 16k tokens that is ~1k blocks; making them costs about a millisecond)."""

    def __init__(self, token_ids: Sequence[int], block_size: int):
        self.blocks = list(zip(*[iter(token_ids)] * block_size))  # the full blocks' tuples, made in C
        self.hashes: list[int] = []
        h, append = None, self.hashes.append
        for t in self.blocks:
            h = hash((h, t))
            append(h)

    def prev(self, i: int) -> int | None:
        """The chain hash before block i."""
        return self.hashes[i - 1] if i else None


class Block:
    __slots__ = ("id", "ref_count", "hash", "prev_hash", "token_ids", "part_hash", "part_prev", "part_ids")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: int | None = NO_HASH
        self.prev_hash: int | None = None
        self.token_ids: tuple[int, ...] = ()
        self.part_hash: int | None = NO_HASH  # the partial entry: its first len(part_ids) tokens
        self.part_prev: int | None = None
        self.part_ids: tuple[int, ...] = ()

    @property
    def cached(self) -> bool:
        return self.hash is not NO_HASH or self.part_hash is not NO_HASH


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is reserved)")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.num_usable = num_blocks - 1
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # uncached, ref 0; pop() -> lowest id
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self._by_hash: dict[int, int] = {}  # full and partial entries (their token tuples differ in length)
        self._num_cached = 0  # blocks with an entry

    # ---- queries ----
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (uncached free + evictable cached)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        return self._num_cached

    def match_prefix(self, prefix: PrefixChain | Sequence[int], max_blocks: int) -> list[int]:
        """Ids of cached blocks holding the longest full-block prefix (token ids, or their chain) (read-only)."""
        if not self.enable_prefix_caching:
            return []
        chain = prefix if isinstance(prefix, PrefixChain) else PrefixChain(prefix, self.block_size)
        out, prev, by_hash, blocks = [], None, self._by_hash, self.blocks
        for h, toks, _ in zip(chain.hashes, chain.blocks, range(max_blocks)):
            bid = by_hash.get(h)
            if bid is None:
                break
            b = blocks[bid]
            if b.token_ids != toks or b.prev_hash != prev:  # a hash collision, not a hit
                break
            out.append(bid)
            prev = h
        return out

    def match_partial(self, prev_hash: int | None, token_ids: tuple[int, ...], h: int | None = None) -> int | None:
        """The id of a cached block whose first tokens are `token_ids` after the chain `prev_hash` (a
        partial entry), or None (read-only)."""
        if not self.enable_prefix_caching:
            return None
        bid = self._by_hash.get(block_hash(prev_hash, token_ids) if h is None else h)
        if bid is None:
            return None
        b = self.blocks[bid]
        return bid if b.part_ids == token_ids and b.part_prev == prev_hash else None  # else a collision

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks nobody holds (cached, in the LRU)."""
        blocks = self.blocks
        return sum(1 for bid in block_ids if blocks[bid].ref_count == 0)

    # ---- mutations ----
    def acquire(self, block_ids: Sequence[int]) -> None:
        """Takes a reference on cached blocks (prefix hits)."""
        for bid in block_ids:
            b = self.blocks[bid]
            if b.ref_count == 0:
                del self._lru[bid]
            b.ref_count += 1

    def touch(self, block_id: int) -> None:
        """A cached block nobody holds was used (a partial tail copied): it becomes the last to evict."""
        if block_id in self._lru:
            self._lru.move_to_end(block_id)

    def allocate(self) -> int:
        """A fresh block with ref count 1, evicting the least recently used cached block if needed."""
        if self._free:
            bid = self._free.pop()
        elif self._lru:
            bid, _ = self._lru.popitem(last=False)
            self._drop_hash(self.blocks[bid])
        else:
            raise RuntimeError("KV block pool exhausted (admission control should have prevented this)")
        self.blocks[bid].ref_count = 1
        return bid

    def seal(self, block_id: int, prev_hash: int | None, token_ids: Sequence[int], h: int | None = None) -> int:
        """Marks a full block's contents; returns its chain hash (for the next block; `h` when known)."""
        toks = tuple(token_ids)
        assert len(toks) == self.block_size
        h = block_hash(prev_hash, toks) if h is None else h
        if self.enable_prefix_caching and h not in self._by_hash:
            b = self.blocks[block_id]
            self._num_cached += not b.cached
            b.hash, b.prev_hash, b.token_ids = h, prev_hash, toks
            self._by_hash[h] = block_id
        return h  # an identical block already cached keeps serving hits; this one stays private

    def seal_partial(self, block_id: int, prev_hash: int | None, token_ids: Sequence[int], h: int | None = None) -> None:
        """Marks the first 1..block_size-1 tokens of a block as final: a partial entry (see the module's
        doc). Its holder goes on writing the slots after them."""
        toks = tuple(token_ids)
        assert 0 < len(toks) < self.block_size
        h = block_hash(prev_hash, toks) if h is None else h
        b = self.blocks[block_id]
        if self.enable_prefix_caching and h not in self._by_hash and b.part_hash is NO_HASH:
            self._num_cached += not b.cached
            b.part_hash, b.part_prev, b.part_ids = h, prev_hash, toks
            self._by_hash[h] = block_id

    def release(self, block_ids: Sequence[int]) -> None:
        """Drops one reference each. Pass a sequence's table in order: the tail is freed first, so
        it is evicted before the shared prefix."""
        for bid in reversed(block_ids):
            b = self.blocks[bid]
            assert b.ref_count > 0, f"block {bid} released more often than taken"
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.cached:
                    self._lru[bid] = None
                else:
                    self._free.append(bid)

    def _drop_hash(self, b: Block) -> None:
        self._num_cached -= b.cached
        if b.hash is not NO_HASH:
            del self._by_hash[b.hash]
            b.hash, b.prev_hash, b.token_ids = NO_HASH, None, ()
        if b.part_hash is not NO_HASH:
            del self._by_hash[b.part_hash]
            b.part_hash, b.part_prev, b.part_ids = NO_HASH, None, ()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block that nobody holds."""
        while self._lru:
            bid, _ = self._lru.popitem(last=False)
            self._drop_hash(self.blocks[bid])
            self._free.append(bid)

    def check_integrity(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "duplicate ids in the free list"
        assert not free & lru, "a block is both free and cached-free"
        assert 0 not in free and 0 not in lru and self.blocks[0].ref_count == 0, "block 0 is reserved"
        for b in self.blocks[1:]:
            if b.ref_count < 0:
                raise AssertionError(f"block {b.id} has ref count {b.ref_count}")
            if b.ref_count == 0:
                assert (b.id in free) != (b.id in lru), f"free block {b.id} is in neither or both pools"
                assert (b.id in lru) == b.cached, f"block {b.id}: LRU membership != cached"
            else:
                assert b.id not in free and b.id not in lru, f"block {b.id} in use but listed free"
            if b.hash is not NO_HASH:
                assert self._by_hash.get(b.hash) == b.id, f"block {b.id}: hash not indexed"
                assert block_hash(b.prev_hash, b.token_ids) == b.hash, f"block {b.id}: stale hash"
            if b.part_hash is not NO_HASH:
                assert self._by_hash.get(b.part_hash) == b.id, f"block {b.id}: partial entry not indexed"
                assert 0 < len(b.part_ids) < self.block_size, f"block {b.id}: partial entry of {len(b.part_ids)} tokens"
                assert block_hash(b.part_prev, b.part_ids) == b.part_hash, f"block {b.id}: stale partial entry"
        entries = sum((b.hash is not NO_HASH) + (b.part_hash is not NO_HASH) for b in self.blocks)
        assert len(self._by_hash) == entries, "orphan hash entries"
        assert self._num_cached == sum(b.cached for b in self.blocks), "cached-block count drifted"
        assert len(free) + len(lru) + sum(b.ref_count > 0 for b in self.blocks) == self.num_usable
