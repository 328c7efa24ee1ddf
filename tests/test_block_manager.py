import random

import pytest

from openinfer.block_manager import BlockManager


def fill(bm, tokens):
    """Allocates and seals a full-block sequence; returns its table."""
    bs, table, prev = bm.block_size, [], None
    for i in range(len(tokens) // bs):
        b = bm.allocate()
        table.append(b)
        prev = bm.seal(b, prev, tokens[i * bs:(i + 1) * bs])
    return table


def test_block_zero_reserved_and_exhaustion():
    bm = BlockManager(5, 4)
    got = [bm.allocate() for _ in range(4)]
    assert sorted(got) == [1, 2, 3, 4] and bm.num_free == 0
    with pytest.raises(RuntimeError):
        bm.allocate()
    bm.release(got)
    bm.check_integrity()
    assert bm.num_free == 4


def test_prefix_hit_and_verification():
    bm = BlockManager(10, 4)
    toks = list(range(12))
    table = fill(bm, toks)
    assert bm.match_prefix(toks, 10) == table
    assert bm.match_prefix(toks + [99], 2) == table[:2]
    assert bm.match_prefix([0, 1, 2, 3, 9, 9, 9, 9], 10) == table[:1]
    assert bm.match_prefix([5] + toks[1:], 10) == []  # chained: a changed first block breaks the chain
    bm.release(table)
    assert bm.num_free == 9 and bm.num_cached == 3
    hit = bm.match_prefix(toks, 10)
    bm.acquire(hit)  # taking cached free blocks back out of the LRU
    assert bm.num_free == 6
    bm.check_integrity()
    # a forged hash entry must not count as a hit: token ids are verified
    b = bm.blocks[hit[0]]
    b.token_ids = (7, 7, 7, 7)
    assert bm.match_prefix(toks, 10) == []


def test_lru_evicts_tail_first_and_oldest_first():
    bm = BlockManager(7, 2)
    a = fill(bm, [1, 2, 3, 4, 5, 6])
    b = fill(bm, [9, 9, 8, 8])
    bm.release(a)  # a's tail is freed first, so evicted first
    bm.release(b)
    assert bm.num_free == 6
    got = [bm.allocate() for _ in range(3)]
    assert got == [6, a[2], a[1]]  # never-cached free block first, then the LRU from a's tail
    assert bm.match_prefix([1, 2, 3, 4, 5, 6], 3) == a[:1]
    assert bm.match_prefix([9, 9, 8, 8], 2) == b
    bm.check_integrity()


def test_disabled_prefix_cache():
    bm = BlockManager(6, 2, enable_prefix_caching=False)
    t = fill(bm, [1, 2, 3, 4])
    bm.release(t)
    assert bm.match_prefix([1, 2, 3, 4], 2) == [] and bm.num_cached == 0
    bm.check_integrity()


def test_partial_entries():
    """A prompt's partial tail: found by its chain and tokens only, a block can hold it and later its full
    entry, cached at ref 0 like a full block, and eviction drops both entries."""
    bm = BlockManager(6, 4)
    table = fill(bm, [1, 2, 3, 4])
    prev = bm.blocks[table[0]].hash
    b = bm.allocate()
    bm.seal_partial(b, prev, (5, 6))
    assert bm.match_partial(prev, (5, 6)) == b and bm.num_cached == 2
    assert bm.match_partial(prev, (5,)) is None and bm.match_partial(prev, (5, 6, 7)) is None
    assert bm.match_partial(None, (5, 6)) is None  # another chain
    bm.seal_partial(b, prev, (5, 6))  # again: nothing changes
    c = bm.allocate()
    bm.seal_partial(c, prev, (5, 6))  # an identical entry elsewhere: the first keeps serving
    assert bm.match_partial(prev, (5, 6)) == b and not bm.blocks[c].cached
    bm.seal(b, prev, (5, 6, 7, 8))  # the block filled up: both entries
    assert bm.num_cached == 2 and bm.match_prefix([1, 2, 3, 4, 5, 6, 7, 8], 2) == table + [b]
    assert bm.match_partial(prev, (5, 6)) == b
    bm.check_integrity()
    bm.release([c])
    bm.release(table + [b])  # b first, then table[0]: both to the LRU; c was never cached
    assert bm.num_free == 5 and bm.num_cached == 2
    bm.check_integrity()
    got = [bm.allocate() for _ in range(4)]  # the uncached ones first (c's id is reused), then b (oldest)
    assert b in got and table[0] not in got
    assert bm.match_partial(prev, (5, 6)) is None and bm.num_cached == 1
    bm.check_integrity()
    with pytest.raises(AssertionError):
        bm.seal_partial(got[0], prev, (1, 2, 3, 4))  # a whole block is not a partial tail
    off = BlockManager(4, 4, enable_prefix_caching=False)
    d = off.allocate()
    off.seal_partial(d, None, (1,))
    assert off.match_partial(None, (1,)) is None and off.num_cached == 0


def test_random_operations_keep_integrity():
    rng = random.Random(0)
    bm = BlockManager(40, 4)
    live: list[list[int]] = []
    vocab = [[rng.randrange(3) for _ in range(4)] for _ in range(3)]  # few distinct blocks: many hits
    for _ in range(3000):
        op = rng.random()
        if op < 0.5:
            toks = [t for _ in range(rng.randint(1, 6)) for t in rng.choice(vocab)]
            hits = bm.match_prefix(toks, len(toks) // 4)
            partial = rng.random() < 0.3  # plus a partial block that never gets sealed
            need = len(toks) // 4 - len(hits) + bm.num_free_among(hits) + partial
            if need > bm.num_free:
                continue
            bm.acquire(hits)
            table, prev = list(hits), (bm.blocks[hits[-1]].hash if hits else None)
            for i in range(len(hits), len(toks) // 4):
                blk = bm.allocate()
                table.append(blk)
                prev = bm.seal(blk, prev, toks[i * 4:(i + 1) * 4])
            if partial:  # a partial block, registered as a prompt's partial tail half of the time
                table.append(bm.allocate())
                if rng.random() < 0.5:
                    bm.seal_partial(table[-1], prev, tuple(rng.choice(vocab)[:rng.randint(1, 3)]))
            live.append(table)
        elif live:
            bm.release(live.pop(rng.randrange(len(live))))
        if rng.random() < 0.01:
            bm.reset_prefix_cache()
        bm.check_integrity()
    held = {b for t in live for b in t}
    assert all(bm.blocks[b].ref_count > 0 for b in held)
    for t in live:
        bm.release(t)
    bm.check_integrity()
    assert bm.num_free == bm.num_usable


def test_touch_makes_a_cached_block_the_last_to_evict():
    bm = BlockManager(4, 2)
    a, b, c = fill(bm, [1, 2]), fill(bm, [3, 4]), fill(bm, [5, 6])
    for t in (a, b, c):
        bm.release(t)
    bm.touch(a[0])  # oldest until used
    bm.touch(0)  # block 0 is never cached: nothing happens
    assert [bm.allocate() for _ in range(2)] == [b[0], c[0]]
    assert bm.match_prefix([1, 2], 1) == a
    bm.check_integrity()
