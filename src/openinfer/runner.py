"""Packs a scheduled step into the backend's StepInput (openinfer.step) and runs it. The runner decides
nothing: what runs, which blocks and which copies come from the scheduler."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from .scheduler import ScheduledBatch
from .step import Backend, StepInput, StepOutput


def pack(batch: ScheduledBatch, block_size: int) -> StepInput:
    items = batch.items
    lens = np.array([it.num_tokens for it in items], dtype=np.int32)
    starts = np.array([it.start for it in items], dtype=np.int32)
    qsl = np.zeros(len(items) + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    fed = any(it.feed_row >= 0 for it in items)

    def tokens(it):
        if it.feed_row >= 0:  # still on the device: a placeholder (prev_rows says where to take it from)
            return (0,)
        if it.drafts:  # verify: the anchor (the last kept token) and the proposals after it
            return (it.seq.token_ids[it.start], *it.drafts)
        return it.seq.token_ids[it.start:it.start + it.num_tokens]
    input_ids = np.fromiter((t for it in items for t in tokens(it)), dtype=np.int32, count=int(qsl[-1]))
    row = np.repeat(np.arange(len(items)), lens)  # sequence of each token
    positions = (starts[row] + np.arange(qsl[-1]) - qsl[:-1][row]).astype(np.int32)
    width = max((len(it.seq.block_table) for it in items), default=1)
    block_tables = np.zeros((len(items), width), dtype=np.int32)  # padding entries: block 0
    for b, it in enumerate(items):
        block_tables[b, :len(it.seq.block_table)] = it.seq.block_table
    slot_mapping = (block_tables[row, positions // block_size] * block_size
                    + positions % block_size).astype(np.int32)
    verify = any(it.drafts for it in items)
    if verify:  # every row of a verify item samples
        rows = [it.num_rows for it in items]
        sample_idx = np.concatenate([np.arange(qsl[b + 1] - n, qsl[b + 1]) for b, n in enumerate(rows) if n]
                                    or [np.zeros(0, np.int64)]).astype(np.int32)
        sampled = [it for it, n in zip(items, rows) for _ in range(n)]
    else:  # an item samples its last token when it reaches the end of the known tokens
        sampled = [it for it in items if it.sample]
        sample_idx = (qsl[1:][np.array([it.sample for it in items], dtype=bool)] - 1).astype(np.int32)
    return StepInput(
        input_ids=input_ids, positions=positions, query_start_loc=qsl, context_lens=starts + lens,
        block_tables=block_tables, slot_mapping=slot_mapping,
        sample_idx=sample_idx,
        temperature=np.array([it.seq.params.temperature for it in sampled], dtype=np.float32),
        top_p=np.array([it.seq.params.top_p for it in sampled], dtype=np.float32),
        top_k=np.array([it.seq.params.top_k for it in sampled], dtype=np.int32),
        seeds=np.array([it.seq.seed for it in sampled], dtype=np.uint64),
        num_logprobs=max((it.seq.params.logprobs or 0 for it in sampled), default=0),
        prev_rows=np.array([it.feed_row for it in items], dtype=np.int32) if fed else None,
        kv_save=np.array(batch.kv_save, dtype=np.int32).reshape(-1, 2),
        kv_load=np.array(batch.kv_load, dtype=np.int32).reshape(-1, 2),
        kv_load_wait=batch.kv_load_wait,
        verify=verify,
        draft=np.array([it.draft for it in items], dtype=np.int32) if any(it.draft for it in items) else None,
    )


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
