"""The host KV tier's bookkeeping: which host slot holds which sealed block (or a prompt's partial tail,
BlockManager.seal_partial), found by the prefix cache's chained block hash; LRU eviction; pins on slots a
copy is using. Policy only: the backend owns the bytes (StepInput.kv_save / kv_load move them), the
scheduler decides when.

A slot is *saving* from the moment a save is queued until its copy has landed: it is not matchable then
(its bytes are not there yet) and cannot be evicted. A *landed* slot serves prefix hits; while a restore
reads it, it is pinned and cannot be evicted either.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from .block_manager import PrefixChain, block_hash


class _Entry:
    __slots__ = ("hash", "prev_hash", "token_ids", "landed", "pins")

    def __init__(self, h: int, prev_hash: int | None, token_ids: tuple[int, ...]):
        self.hash, self.prev_hash, self.token_ids = h, prev_hash, token_ids
        self.landed = False
        self.pins = 0


class HostTier:
    def __init__(self, num_slots: int, block_size: int):
        if num_slots < 1:
            raise ValueError("the host tier needs at least one slot")
        self.num_slots = num_slots
        self.block_size = block_size
        self._entries: list[_Entry | None] = [None] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() -> lowest slot
        self._lru: OrderedDict[int, None] = OrderedDict()  # landed, unpinned; oldest first
        self._by_hash: dict[int, int] = {}
        self.evictions = 0

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def __contains__(self, h: int) -> bool:
        return h in self._by_hash

    def match(self, prefix: PrefixChain | Sequence[int], first_block: int, max_blocks: int) -> list[int]:
        """Landed slots holding blocks first_block, first_block + 1, ... of a prefix (token ids, or their
        chain), up to block max_blocks - 1; read-only."""
        chain = prefix if isinstance(prefix, PrefixChain) else PrefixChain(prefix, self.block_size)
        out = []
        for i in range(first_block, min(max_blocks, len(chain.blocks))):
            slot = self._by_hash.get(chain.hashes[i])
            if slot is None:
                break
            e = self._entries[slot]
            if not e.landed or e.token_ids != chain.blocks[i] or e.prev_hash != chain.prev(i):  # in flight, or a collision
                break
            out.append(slot)
        return out

    def match_partial(self, prev_hash: int | None, token_ids: tuple[int, ...], h: int | None = None) -> int | None:
        """The landed slot of a prompt's partial tail (BlockManager.seal_partial's entry), or None; read-only."""
        slot = self._by_hash.get(block_hash(prev_hash, token_ids) if h is None else h)
        if slot is None:
            return None
        e = self._entries[slot]
        return slot if e.landed and e.token_ids == token_ids and e.prev_hash == prev_hash else None

    def entry(self, slot: int) -> tuple[int, int | None, tuple[int, ...]]:
        e = self._entries[slot]
        return e.hash, e.prev_hash, e.token_ids

    def reserve(self, h: int, prev_hash: int | None, token_ids: Sequence[int]) -> int | None:
        """A slot for a save of block `h` (a free one, else the least recently used landed one): saving and
        pinned until landed(). None when `h` is already here or every slot is busy."""
        if h in self._by_hash:
            return None
        if self._free:
            slot = self._free.pop()
        elif self._lru:
            slot, _ = self._lru.popitem(last=False)
            del self._by_hash[self._entries[slot].hash]
            self.evictions += 1
        else:
            return None
        e = self._entries[slot] = _Entry(h, prev_hash, tuple(token_ids))
        e.pins = 1
        self._by_hash[h] = slot
        return slot

    def landed(self, slot: int) -> None:
        """The save into `slot` has landed: it serves hits from now on."""
        e = self._entries[slot]
        assert not e.landed, f"slot {slot} landed twice"
        e.landed = True
        self.unpin(slot)

    def forget(self, slot: int) -> None:
        """A save that was never issued: the slot is free again."""
        e = self._entries[slot]
        assert not e.landed and e.pins == 1, f"slot {slot} is not a save in flight"
        del self._by_hash[e.hash]
        self._entries[slot] = None
        self._free.append(slot)

    def pin(self, slot: int) -> None:
        """A restore reads `slot`: keep it until unpin()."""
        e = self._entries[slot]
        if e.pins == 0:
            del self._lru[slot]
        e.pins += 1

    def unpin(self, slot: int) -> None:
        e = self._entries[slot]
        assert e.pins > 0, f"slot {slot} unpinned more often than pinned"
        e.pins -= 1
        if e.pins == 0:
            self._lru[slot] = None  # most recently used

    def pins(self, slot: int) -> int:
        e = self._entries[slot]
        return e.pins if e is not None else 0

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate slots in the free list"
        for slot, e in enumerate(self._entries):
            if slot in free:
                assert e is None or self._by_hash.get(e.hash) != slot, f"free slot {slot} still indexed"
                assert slot not in self._lru, f"free slot {slot} in the LRU"
                continue
            assert e is not None and self._by_hash.get(e.hash) == slot, f"slot {slot}: not indexed"
            assert e.pins >= 0 and (e.landed or e.pins >= 1), f"slot {slot}: a save in flight must stay pinned"
            assert (slot in self._lru) == (e.pins == 0), f"slot {slot}: LRU membership != unpinned"
            assert block_hash(e.prev_hash, e.token_ids) == e.hash, f"slot {slot}: stale hash"
        assert len(self._by_hash) == self.num_slots - len(free), "orphan hash entries"
