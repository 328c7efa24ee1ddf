"""Who runs each step: full-lifetime admission, chunked prefill under a token budget, decode rows,
stop checks, finish and abort. Policy only: no arrays, no device memory.

Admission reserves, for each admitted request, every block it can ever need (prompt + max_tokens,
less prefix-cache hits) so a running request never waits for memory and nothing is preempted.
Blocks are still allocated lazily; the not-yet-allocated part of each reservation is its
"promise", and the pool's free blocks (including evictable cached ones) always cover all promises.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from .backend import StepOutput
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams
from .tokenizer import Tokenizer


class RequestRejected(ValueError):
    """The request can never run (too long for max_model_len or the KV pool); a client error."""


class QueueFull(RuntimeError):
    """The waiting queue is at max_waiting; retry later."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-prob), best first; empty when logprobs=0


@dataclass
class RequestUpdate:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" when finished
    logprobs: list[Logprob] | None  # one per new token when the request asked for logprobs
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 max_len: int, block_size: int, detok: IncrementalDetokenizer):
        self.request_id = request_id
        self.params = params
        self.seed = seed
        self.token_ids = list(prompt_token_ids)
        self.num_prompt = len(self.token_ids)
        self.max_len = max_len  # prompt + output tokens at most
        # the last token is sampled, never fed back: K/V for max_len - 1 tokens at most
        self.blocks_needed = -(-(max_len - 1) // block_size)
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.num_sealed = 0
        self.last_hash: int | None = None
        self.num_cached_tokens = 0
        self.detok = detok
        self.status = Status.WAITING
        self.finish_reason: str | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def promise(self) -> int:
        return self.blocks_needed - len(self.block_table)


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # position of the first token computed this step
    num_tokens: int
    sample: bool  # this chunk reaches the end of the known tokens: it produces a token
    feed_row: int = -1  # >= 0: the input token is row feed_row of the step still in flight (not on the host yet)


@dataclass
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_promised: int
    prefix_cache_hit_tokens: int
    prefix_cache_queried_tokens: int
    prompt_tokens: int  # prompt tokens of admitted requests
    prefill_tokens_computed: int  # prompt tokens actually run through the model
    generation_tokens: int
    num_finished: int


class Scheduler:
    def __init__(self, block_manager: BlockManager, tokenizer: Tokenizer, *, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_waiting: int,
                 eos_token_ids: tuple[int, ...] = ()):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        self.bm = block_manager
        self.bs = block_manager.block_size
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self._counters = dict(prefix_cache_hit_tokens=0, prefix_cache_queried_tokens=0, prompt_tokens=0,
                              prefill_tokens_computed=0, generation_tokens=0, num_finished=0)

    # ---- requests ----
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int) -> Sequence:
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        pool_tokens = self.bm.num_usable * self.bs
        if params.max_tokens is None:
            # "up to max_model_len", bounded by what the KV pool can ever hold (K/V of all but the last)
            max_len = min(self.max_model_len, pool_tokens + 1)
            if n >= max_len:
                raise RequestRejected(f"the prompt has {n} tokens, leaving no room to generate within "
                                      f"{max_len} tokens (max_model_len {self.max_model_len}, KV pool "
                                      f"{pool_tokens} tokens)")
        else:
            max_len = n + params.max_tokens
            if max_len > self.max_model_len:
                raise RequestRejected(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {max_len} "
                                      f"exceeds max_model_len ({self.max_model_len})")
            if max_len - 1 > pool_tokens:  # the K/V of every token but the last sampled one
                raise RequestRejected(f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs "
                                      f"{-(-(max_len - 1) // self.bs)} KV blocks but the pool has only "
                                      f"{self.bm.num_usable}")
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests)")
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop)
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, max_len, self.bs, detok)
        self.waiting.append(seq)
        self.requests[request_id] = seq
        return seq

    def abort(self, request_id: str) -> bool:
        """Drops a request at once and frees its blocks; False when it is unknown or already done."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        self._free(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----
    def schedule(self) -> ScheduledBatch:
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        for seq in self.running:  # decode rows first: one token each
            if seq.num_computed >= seq.num_prompt:
                batch.items.append(ScheduledSeq(seq, seq.num_computed, 1, True))
                budget -= 1
        for seq in self.running:  # prefills already under way, in admission order
            if seq.num_computed < seq.num_prompt and budget > 0:
                budget -= self._add_chunk(batch, seq, budget)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            budget -= self._add_chunk(batch, seq, budget)
        self._allocate(batch)
        return batch

    def _allocate(self, batch: ScheduledBatch) -> None:
        for it in batch.items:  # lazy allocation: always succeeds thanks to the promises
            need = -(-(it.start + it.num_tokens) // self.bs)
            while len(it.seq.block_table) < need:
                it.seq.block_table.append(self.bm.allocate())

    def _add_chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int, start: int | None = None) -> int:
        start = seq.num_computed if start is None else start
        n = min(seq.num_prompt - start, budget)
        batch.items.append(ScheduledSeq(seq, start, n, start + n == seq.num_prompt))
        self._counters["prefill_tokens_computed"] += n
        return n

    def promised_blocks(self) -> int:
        return sum(s.promise for s in self.running)

    def _admission_cost(self, seq: Sequence) -> tuple[list[int], int]:
        """(prefix-cache hits, blocks admission takes from the pool's uncommitted free blocks)."""
        # a hit never covers the last prompt token: it must be recomputed to produce logits
        hits = self.bm.match_prefix(seq.token_ids, (seq.num_prompt - 1) // self.bs)
        taken_from_free = sum(self.bm.is_free(b) for b in hits)
        return hits, (seq.blocks_needed - len(hits)) + taken_from_free

    # ---- overlapped steps ----
    def schedule_next(self, prev: ScheduledBatch) -> ScheduledBatch | None:
        """The step after `prev`, scheduled while prev runs (before its postprocess()): what schedule()
        would return once prev is done, except that a row whose input is prev's sampled token takes it
        on the device (feed_row: prev's output row). Those rows come first, one token each (the backend
        feeds rows at their own index); then prompt chunks, then admissions. A sequence that stops on
        prev's token (EOS, a stop string) wastes its row: postprocess() skips rows of finished
        sequences; one that prev's token ends by length gets none. None when nothing would run."""
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        after_prev: dict[int, int] = {}  # id(seq) -> tokens computed once prev has run
        row = 0
        for it in prev.items:
            seq, r = it.seq, row
            row += it.sample
            if seq.status is not Status.RUNNING:
                continue
            after_prev[id(seq)] = it.start + it.num_tokens
            if it.sample and len(seq.token_ids) + 1 < seq.max_len:
                batch.items.append(ScheduledSeq(seq, it.start + it.num_tokens, 1, True, feed_row=r))
                budget -= 1
        for seq in self.running:  # prompts under way, in admission order
            done = after_prev.get(id(seq), seq.num_computed)
            if done < seq.num_prompt and budget > 0:
                budget -= self._add_chunk(batch, seq, budget, start=done)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            budget -= self._add_chunk(batch, seq, budget)
        if not batch.items:
            return None
        self._allocate(batch)
        return batch

    def _admit(self, seq: Sequence) -> bool:
        hits, cost = self._admission_cost(seq)
        if cost > self.bm.num_free - self.promised_blocks():
            return False
        self.bm.acquire(hits)
        seq.block_table = list(hits)
        seq.num_computed = seq.num_cached_tokens = len(hits) * self.bs
        seq.num_sealed = len(hits)
        seq.last_hash = self.bm.blocks[hits[-1]].hash if hits else None
        seq.status = Status.RUNNING
        self.running.append(seq)
        c = self._counters
        c["prefix_cache_queried_tokens"] += seq.num_prompt
        c["prefix_cache_hit_tokens"] += seq.num_cached_tokens
        c["prompt_tokens"] += seq.num_prompt
        return True

    def postprocess(self, batch: ScheduledBatch, out: StepOutput) -> list[RequestUpdate]:
        updates, row = [], 0
        try:
            for it in batch.items:
                seq = it.seq
                r = row
                row += it.sample
                if seq.status is not Status.RUNNING:  # aborted (or finished) while the step ran
                    continue
                seq.num_computed = it.start + it.num_tokens
                self._seal(seq)
                if it.sample:
                    updates.append(self._append_token(seq, out, r))
        finally:  # a finished sequence must never stay in `running`, even if a later one raised
            if any(s.status is Status.FINISHED for s in self.running):
                self.running = [s for s in self.running if s.status is Status.RUNNING]
        return updates

    def _seal(self, seq: Sequence) -> None:
        while (seq.num_sealed + 1) * self.bs <= seq.num_computed:
            i = seq.num_sealed
            seq.last_hash = self.bm.seal(seq.block_table[i], seq.last_hash,
                                         seq.token_ids[i * self.bs:(i + 1) * self.bs])
            seq.num_sealed += 1

    def _append_token(self, seq: Sequence, out: StepOutput, r: int) -> RequestUpdate:
        p, tok = seq.params, int(out.tokens[r])
        seq.token_ids.append(tok)
        self._counters["generation_tokens"] += 1
        lps = None
        if p.logprobs is not None:
            top = []
            if p.logprobs > 0 and out.top_ids is not None:
                top = [(int(i), float(v)) for i, v in zip(out.top_ids[r, :p.logprobs], out.top_logprobs[r, :p.logprobs])]
            lps = [Logprob(tok, float(out.logprobs[r]), top)]
        reason = None
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_set:
            text, reason = "", "stop"  # the stop token's text is not part of the output
        else:
            text, hit = seq.detok.add_token(tok)
            if hit:
                reason = "stop"
        if reason is None and len(seq.token_ids) >= seq.max_len:
            reason = "length"
        if reason is not None:
            text += seq.detok.flush()
            self.requests.pop(seq.request_id, None)
            self._free(seq, reason)
        return RequestUpdate(seq.request_id, [tok], text, reason is not None, reason, lps, seq.num_prompt,
                             len(seq.token_ids) - seq.num_prompt, seq.num_cached_tokens)

    def _free(self, seq: Sequence, reason: str) -> None:
        self.bm.release(seq.block_table)
        seq.block_table = []
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._counters["num_finished"] += 1

    def stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              kv_blocks_total=self.bm.num_usable, kv_blocks_used=self.bm.num_used,
                              kv_blocks_free=self.bm.num_free, kv_blocks_cached=self.bm.num_cached,
                              kv_blocks_promised=self.promised_blocks(), **self._counters)
