"""Packs a scheduled step into the backend's StepInput (openinfer.step) and runs it. The runner decides
nothing: what runs, which blocks and which copies come from the scheduler."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .scheduler import ScheduledBatch
from .step import Backend, StepInput, StepOutput

# Up to this many tokens, a step's token arrays are built as Python lists and
# converted once each; beyond, with NumPy's vector operations. A lone request's step is packed right
# before its launch, on the path to its first token, when the CPU's caches hold the last step's data
# instead of NumPy's code: there the lists take 100 us, the vector operations 210 (a 5-token prefill on
# the 2-vCPU VM; 18 and 45 us in a warm loop).
SMALL = 256


def pack(batch: ScheduledBatch, block_size: int) -> StepInput:
    items = batch.items
    qsl = [0]
    for it in items:
        qsl.append(qsl[-1] + it.num_tokens)
    width = max((len(it.seq.block_table) for it in items), default=1)
    block_tables = np.array([it.seq.block_table + [0] * (width - len(it.seq.block_table)) for it in items],
                            dtype=np.int32).reshape(len(items), width)  # padding entries: block 0
    if qsl[-1] <= SMALL:
        input_ids, positions, slot_mapping = _tokens_lists(items, block_size)
    else:
        input_ids, positions, slot_mapping = _tokens_numpy(items, qsl, block_tables, block_size)
    verify = any(it.drafts for it in items)
    if verify:  # every row of a verify item samples
        sampled = [it for it in items for _ in range(it.num_rows)]
        sample_idx = [i for b, it in enumerate(items) for i in range(qsl[b + 1] - it.num_rows, qsl[b + 1])]
    else:  # an item samples its last token when it reaches the end of the known tokens
        sampled = [it for it in items if it.sample]
        sample_idx = [qsl[b + 1] - 1 for b, it in enumerate(items) if it.sample]
    fed = any(it.feed_row >= 0 for it in items)
    return StepInput(
        input_ids=input_ids, positions=positions, query_start_loc=np.array(qsl, dtype=np.int32),
        context_lens=np.array([it.start + it.num_tokens for it in items], dtype=np.int32),
        block_tables=block_tables, slot_mapping=slot_mapping,
        sample_idx=np.array(sample_idx, dtype=np.int32),
        temperature=np.array([it.seq.params.temperature for it in sampled], dtype=np.float32),
        top_p=np.array([it.seq.params.top_p for it in sampled], dtype=np.float32),
        top_k=np.array([it.seq.params.top_k for it in sampled], dtype=np.int32),
        seeds=np.array([it.seq.seed for it in sampled], dtype=np.uint64),
        num_logprobs=max((it.seq.params.logprobs or 0 for it in sampled), default=0),
        prev_rows=np.array([it.feed_row for it in items], dtype=np.int32) if fed else None,
        kv_save=np.array(batch.kv_save, dtype=np.int32).reshape(-1, 2),
        kv_load=np.array(batch.kv_load, dtype=np.int32).reshape(-1, 2),
        kv_load_wait=batch.kv_load_wait,
        kv_copy=np.array(batch.kv_copy, dtype=np.int32).reshape(-1, 2),
        verify=verify,
        draft=np.array([it.draft for it in items], dtype=np.int32) if any(it.draft for it in items) else None,
    )


def _item_tokens(it):
    if it.feed_row >= 0:  # still on the device: a placeholder (prev_rows says where to take it from)
        return (0,)
    if it.drafts:  # verify: the anchor (the last kept token) and the proposals after it
        return (it.seq.token_ids[it.start], *it.drafts)
    return it.seq.token_ids[it.start:it.start + it.num_tokens]


def _tokens_lists(items, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """input_ids, positions and slot_mapping of a few tokens, from Python lists."""
    ids, positions, slots = [], [], []
    for it in items:
        ids += _item_tokens(it)
        table = it.seq.block_table
        for p in range(it.start, it.start + it.num_tokens):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    return (np.array(ids, dtype=np.int32), np.array(positions, dtype=np.int32),
            np.array(slots, dtype=np.int32))


def _tokens_numpy(items, qsl: list[int], block_tables: np.ndarray, block_size: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same with NumPy's vector operations: many tokens."""
    n = qsl[-1]
    input_ids = np.fromiter((t for it in items for t in _item_tokens(it)), dtype=np.int32, count=n)
    lens = np.array([it.num_tokens for it in items], dtype=np.int32)
    starts = np.array([it.start for it in items], dtype=np.int32)
    row = np.repeat(np.arange(len(items)), lens)  # sequence of each token
    positions = (starts[row] + np.arange(n) - np.array(qsl[:-1], dtype=np.int32)[row]).astype(np.int32)
    slot_mapping = (block_tables[row, positions // block_size] * block_size
                    + positions % block_size).astype(np.int32)
    return input_ids, positions, slot_mapping


class Runner:
    def __init__(self, backend: Backend, block_size: int):
        self.backend = backend
        self.block_size = block_size

    def launch(self, batch: ScheduledBatch, before_launch: Callable[[], None] | None = None) -> None:
        """Queues a step on the backend (at most two in flight); collect() returns outputs in order."""
        step = pack(batch, self.block_size)
        if before_launch is not None:
            before_launch()
        # after packing and the hand-over of the last step's updates: the backend call alone from here
        batch.t_launched = time.perf_counter_ns()
        self.backend.launch(step)

    def collect(self) -> StepOutput:
        """The oldest launched step's output; its rows follow the batch's sampling items in order."""
        return self.backend.collect()
