"""Attention work items as plan_step makes them (csrc/engine/plan.cu through `_engine.ops.attention_work`, host
code only: no GPU needed): short chunks (verify spans of up to ATTN_SHORT_CHUNK tokens) in items of 16 query rows
while every sequence holds at most ATTN_SHORT_ITEMS_MAX_CTX keys, so that they take the decode launch; prompt
chunks, mixed steps, decode rows and --deterministic steps (short_items off) keep their items."""
from __future__ import annotations

import numpy as np
import pytest

ops = pytest.importorskip("openinfer._engine", reason="the compiled engine is not built").ops
LIMIT = ops.ATTN_SHORT_ITEMS_MAX_CTX


def work(lens, group, short=True, ctx=None):
    """(items as (seq, tok_start, num_tok, lead), max_rows) of one step of sequences of `lens` new tokens."""
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    items, max_rows = ops.attention_work(qsl, group, short_items=short,
                                         context_lens=None if ctx is None else np.array(ctx, np.int32))
    return [tuple(i) for i in items], max_rows


def test_short_chunk_is_a_dflash_span():
    assert ops.ATTN_SHORT_CHUNK == 16  # the cases below cut spans of up to 16 tokens, not 17


def test_span_of_8_at_group_4():
    """4B/8B verify (span 8, group 4): two items of 4 tokens up to the context limit (inclusive), one of 32 rows past
    it, short items whatever the context when none is given (a graph's capture), one item with short_items off."""
    two = ([(0, 0, 4, 0), (0, 4, 4, 4)], 16)
    one = ([(0, 0, 8, 0)], 32)
    for ctx in (8, 13, 1032, LIMIT):
        assert work([8], 4, ctx=[ctx]) == two, ctx
    assert work([8], 4, ctx=[LIMIT + 1]) == one
    assert work([8], 4, ctx=[LIMIT + 4000]) == one
    assert work([8], 4) == two
    assert work([8], 4, short=False, ctx=[1032]) == one
    assert work([8], 4, short=False) == one


@pytest.mark.parametrize("group,n,sizes", [
    (8, 8, [2, 2, 2, 2]),        # 32B: 2 tokens x 8 heads
    (8, 16, [2] * 8),            # DFlash's span of 16
    (4, 16, [4, 4, 4, 4]),
    (5, 8, [3, 3, 2]),           # 15 rows, the last item shorter
    (2, 16, [8, 8]),             # 0.6B/1.7B at span 16
    (2, 8, [8]),                 # 16 rows already: one item, as before
    (1, 16, [16]),
    (4, 4, [4]),
    (4, 17, [17]),               # longer than ATTN_SHORT_CHUNK: a prompt chunk's items
])
def test_short_items_by_group(group, n, sizes):
    items, max_rows = work([n], group, ctx=[1000 + n])
    assert [i[2] for i in items] == sizes
    assert [i[1] for i in items] == [i[3] for i in items] == list(np.cumsum([0] + sizes[:-1]))
    assert max_rows == max(sizes) * group
    if n <= 16:
        assert max_rows <= 16


def test_groups_over_16_rows_are_not_cut():
    """A group of more than 16 heads fills a decode block alone: nothing to gain from cutting."""
    for n in (1, 4, 8, 16):
        assert work([n], 32, ctx=[n]) == work([n], 32, short=False)


def test_three_sequences():
    """Each sequence's span in its own items (lead counts from its own first token); one sequence past the limit
    keeps every span whole: its 32-row item makes the launch a row-warp one whatever the others are cut to."""
    items, max_rows = work([8, 8, 8], 4, ctx=[8, 13, 1008])
    assert items == [(0, 0, 4, 0), (0, 4, 4, 4), (1, 8, 4, 0), (1, 12, 4, 4), (2, 16, 4, 0), (2, 20, 4, 4)]
    assert max_rows == 16
    whole = ([(0, 0, 8, 0), (1, 8, 8, 0), (2, 16, 8, 0)], 32)
    assert work([8, 8, 8], 4, ctx=[8, 13, LIMIT + 8]) == whole
    assert work([8, 8, 8], 4, short=False) == whole
    # sequences of one or few tokens beside the spans stay whole (they fit 16 rows already)
    items, max_rows = work([1, 8, 3], 4, ctx=[500, 900, 20])
    assert items == [(0, 0, 1, 0), (1, 1, 4, 0), (1, 5, 4, 4), (2, 9, 3, 0)] and max_rows == 16


@pytest.mark.parametrize("lens,ctx", [
    ([100], [100]),                          # a prompt
    ([100], [1100]),                         # a chunk after a cached prefix
    ([5000], [5000]),
    ([17], [1000]),
    ([33, 1, 17, 1], [33, 71, 22, 201]),     # mixed prefill and decode
    ([100, 8], [100, 1000]),                 # a prompt chunk beside a verify span: row-warp launch anyway
    ([8, 1, 100], [20, 30, 100]),
    ([1] * 64, list(range(1, 65))),          # decode rows
])
@pytest.mark.parametrize("group", [2, 4, 8])
def test_prompt_chunks_and_mixed_steps_unchanged(lens, ctx, group):
    assert work(lens, group, ctx=ctx) == work(lens, group, short=False)
    assert work(lens, group) == work(lens, group, short=False)


def test_prompt_chunk_items():
    """Items of 128 rows (32 tokens at group 4); lead: the tokens of the chunk before the item."""
    items, max_rows = work([100], 4, ctx=[100])
    assert items == [(0, 0, 32, 0), (0, 32, 32, 32), (0, 64, 32, 64), (0, 96, 4, 96)] and max_rows == 128
    items, _ = work([40, 70], 8, ctx=[40, 500])
    assert items == [(0, 0, 16, 0), (0, 16, 16, 16), (0, 32, 8, 32), (1, 40, 16, 0), (1, 56, 16, 16),
                     (1, 72, 16, 32), (1, 88, 16, 48), (1, 104, 6, 64)]
