"""The step contract: what the runner hands a backend for one engine step and what it gets back.

`StepInput` and `StepOutput` are the only declarations of a step's fields on the Python side
(`csrc/engine/step.h` is the C++ side; docs/architecture.md has the table). Both backends implement
`Backend`: `reference.ReferenceBackend` (NumPy, the oracle and the CPU backend) and
`cuda_backend.CudaBackend` (`_engine`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


def _i32(n: int = 0) -> np.ndarray:
    return np.zeros(n, np.int32)


def _pairs() -> np.ndarray:
    return np.zeros((0, 2), np.int32)


@dataclass
class StepInput:
    """One step's work: T tokens of B sequences (prefill chunks and decode rows, flat), S sampled rows.
    Arrays are NumPy, C-contiguous, of the dtypes named. The backend reads them during launch()/step()
    only; it keeps no reference afterwards."""
    input_ids: np.ndarray        # int32 [T]
    positions: np.ndarray        # int32 [T] absolute position of each token
    query_start_loc: np.ndarray  # int32 [B+1] sequence b's tokens are [qsl[b], qsl[b+1]); qsl[0] = 0, qsl[B] = T
    context_lens: np.ndarray     # int32 [B] tokens in the cache for b after this step (= its last position + 1)
    block_tables: np.ndarray     # int32 [B, M] physical KV blocks of each sequence; unused entries 0
    slot_mapping: np.ndarray     # int32 [T] cache slot (block * block_size + offset) of each token's K/V; -1: none
    sample_idx: np.ndarray       # int32 [S] tokens that produce a sampled token (several per sequence: verify)
    temperature: np.ndarray      # float32 [S] <= 0: greedy
    top_p: np.ndarray            # float32 [S] in (0, 1]
    top_k: np.ndarray            # int32 [S] <= 0: off
    seeds: np.ndarray            # uint64 [S] the request's seed (the draw also depends on the row's position)
    num_logprobs: int = 0        # top-N log-probabilities per sampled row (0: none)
    return_logits: bool = False  # float32 [S, V] logits back (tests)
    # Overlapped steps: prev_rows[b] >= 0 takes row b's input token from row prev_rows[b] of the previous
    # launch's output, on the device. A fed row is one token at index b (they come first).
    prev_rows: np.ndarray | None = None  # int32 [B]
    # Speculative verify of [anchor, d1..dk]: a sequence's sampled rows sit on consecutive tokens, in order;
    # StepOutput.accepted counts how many of their tokens to keep.
    verify: bool = False
    # Speculative decoding with a drafter in the backend: draft[b] = 1 drafts the next round for sequence b
    # after this step (anchor: the token of its last kept row), into StepOutput.drafts.
    draft: np.ndarray | None = None  # int32 [B]
    # Hidden states of the residual stream after each layer in tap_layers, at the tokens tap_rows.
    tap_layers: np.ndarray = field(default_factory=_i32)  # int32 [L] distinct layer indices
    tap_rows: np.ndarray = field(default_factory=_i32)    # int32 [R] token indices
    # Host KV tier copies issued with this step, on copy streams of their own, after every step launched
    # before it (so a save reads K/V those steps wrote, and a load lands after any of them that still writes
    # the block it fills). Neither waits for, nor delays, this step's forward.
    kv_save: np.ndarray = field(default_factory=_pairs)   # int32 [N, 2] (device block, host slot)
    kv_load: np.ndarray = field(default_factory=_pairs)   # int32 [N, 2] (host slot, device block)
    # ... except with kv_load_wait: this step's forward reads what its loads bring (a restore and the chunk
    # after it in one launch), so layer l waits for layer l of every loaded block; the loads then go layer
    # group by layer group, the forward trailing the link. Whatever else the step holds waits with it.
    kv_load_wait: bool = False
    # Device block copies (a prompt's partial tail from the prefix cache into the sequence's own block), every
    # layer's K and V (and the drafter's), in order, on the step's stream before its forward and before the
    # kv_save / kv_load copies issued with it start: a block this step's loads refill is copied out first.
    kv_copy: np.ndarray = field(default_factory=_pairs)   # int32 [N, 2] (source block, destination block)
    force_eager: bool = False    # tests: a decode or verify bucket without its CUDA graph (the same kernels)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)


@dataclass
class StepOutput:
    tokens: np.ndarray                        # int32 [S] sampled token of each sampled row
    logprobs: np.ndarray                      # float32 [S] log-softmax (raw logits) of the sampled token
    top_ids: np.ndarray | None = None         # int32 [S, N] when num_logprobs > 0, best first
    top_logprobs: np.ndarray | None = None    # float32 [S, N]
    logits: np.ndarray | None = None          # float32 [S, V] when return_logits
    accepted: np.ndarray | None = None        # int32 [B] verify: 1 + drafts matched before the first mismatch
    hidden: np.ndarray | None = None          # float32 [R, L, hidden] when tap_rows are asked for
    drafts: np.ndarray | None = None          # int32 [B, k] when draft is given: -1 where b did not draft
    gpu_ms: float = 0.0                       # device time of the forward (0 on the CPU backend)
    draft_ms: float = 0.0                     # time of the drafter's part of the step (device time on CUDA)


class Backend(Protocol):
    """What the engine needs of a backend.

    - `launch(step)` validates the step (ValueError for inputs out of range: nothing is queued then) and
      queues it; at most two steps may be pending. The step's KV writes happen before its attention.
    - `collect()` blocks for the oldest pending step and returns its StepOutput. Steps complete in launch
      order; launches are numbered 1, 2, ... in that order.
    - `step(s)` is launch + collect, with nothing pending.
    - `copy_progress()` never blocks: (s, l) such that the kv_save copies of every launch numbered <= s
      and the kv_load copies of every launch <= l have landed. A device block a save reads, or a load
      fills, must not be given to anyone else until then; a host slot likewise. The caller owns that rule.
    - `wait_copies()` blocks until every issued copy has landed.
    - Buffers: the backend owns the KV pool (`num_kv_blocks` blocks of `block_size` tokens, block 0
      reserved as padding) and the host tier (`num_host_blocks` slots, 0 without one); the caller owns
      which sequence holds which block.
    """

    num_kv_blocks: int
    num_host_blocks: int

    def launch(self, step: StepInput) -> None: ...

    def collect(self) -> StepOutput: ...

    def step(self, step: StepInput) -> StepOutput: ...

    def copy_progress(self) -> tuple[int, int]: ...

    def wait_copies(self) -> None: ...

    def copy_stats(self) -> dict: ...

    def close(self) -> None: ...
