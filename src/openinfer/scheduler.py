"""Who runs each step: full-lifetime admission, chunked prefill under a token budget, decode rows,
stop checks, finish and abort, and the host KV tier's copies. Policy only: no arrays, no device memory.

Admission reserves, for each admitted request, every block it can ever need (prompt + max_tokens,
less prefix-cache hits) so a running request never waits for memory and nothing is preempted.
Blocks are still allocated lazily; the not-yet-allocated part of each reservation is its
"promise", and the pool's free blocks (including evictable cached ones) always cover all promises.

With a host tier, every block is saved to it when sealed, and admission continues the prefix match
there: the hits get device blocks at once, are restored by copy, and the request's prefill starts once
the copy has landed. A block a copy reads or fills is held (an extra reference) until then.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager, PrefixChain, block_hash
from .detokenizer import IncrementalDetokenizer, next_text
from .host_tier import HostTier
from .sampling_params import SamplingParams
from .step import StepOutput
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

    def extend(self, later: "RequestUpdate") -> "RequestUpdate":
        """This update followed by a later one of the same request (several tokens in one step)."""
        self.new_token_ids += later.new_token_ids
        self.new_text += later.new_text
        if self.logprobs is not None:
            self.logprobs += later.logprobs
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.num_output_tokens = later.num_output_tokens
        return self


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 max_len: int, block_size: int, detok: IncrementalDetokenizer, spec_k: int = 0, spec_span: int = 0):
        self.request_id = request_id
        self.params = params
        self.seed = seed
        self.token_ids = list(prompt_token_ids)
        self.num_prompt = len(self.token_ids)
        self.max_len = max_len  # prompt + output tokens at most
        self.bs = block_size
        # the last token is sampled, never fed back: K/V for max_len - 1 tokens at most, plus the positions
        # a round may write past the committed ones (spec_span: the k drafts verified, or a backend
        # drafter's block)
        self.spec_k = spec_k  # drafts per verify round (0: no speculation)
        self.drafts: list[int] = []  # proposals for the next verify step
        self.blocks_needed = -(-(max_len - 1 + spec_span) // block_size)
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.num_sealed = 0
        self.last_hash: int | None = None
        self.num_cached_tokens = 0
        self.detok = detok
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.restoring = False  # host-tier blocks on their way in: no prefill until they land
        self.t_admitted = 0  # perf_counter_ns when admitted (the server's path trace)
        self.t_arrived = time.perf_counter_ns()  # when it joined the waiting queue (the server's queue-wait bound)
        self._chain: PrefixChain | None = None
        self._partial: tuple[int, int | None, tuple[int, ...], int] | None = None

    @property
    def prompt_chain(self) -> PrefixChain:
        """The prompt's full blocks and their chain hashes (made on first use, kept)."""
        if self._chain is None:
            self._chain = PrefixChain(self.token_ids[:self.num_prompt], self.bs)
        return self._chain

    @property
    def prompt_partial(self) -> tuple[int, int | None, tuple[int, ...], int] | None:
        """(block index i, chain hash before it, tokens, their hash) of the prompt's partial tail: the
        tokens of block i before the last prompt token, which a repeat of this prompt copies instead of
        computing (BlockManager's partial entries); None for a prompt of at most one block (computed in
        one chunk) or one whose last token starts a block."""
        n, bs = self.num_prompt, self.bs
        if n <= bs or (n - 1) % bs == 0:
            return None
        if self._partial is None:
            i = (n - 1) // bs
            prev = self.prompt_chain.prev(i)
            toks = tuple(self.token_ids[i * bs:n - 1])
            self._partial = (i, prev, toks, block_hash(prev, toks))
        return self._partial

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
    drafts: list[int] = field(default_factory=list)  # verify: the input is [anchor, *drafts], every row samples
    draft: bool = False  # the backend drafts the next round after this step (a drafter in the backend)

    @property
    def num_rows(self) -> int:
        """Sampled rows of this item in the step's output."""
        return 1 + len(self.drafts) if self.drafts else int(self.sample)


@dataclass
class Restore:
    seq: Sequence
    blocks: list[tuple[int, int]]  # (host slot, device block), in prefix order
    first: int  # index of the first restored block in the sequence's table


@dataclass
class ScheduledBatch:
    items: list[ScheduledSeq] = field(default_factory=list)
    kv_save: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    restores: list[Restore] = field(default_factory=list)
    kv_load_wait: bool = False  # its chunks read what its restores bring (StepInput.kv_load_wait)
    copies: list[tuple["Sequence", int, int]] = field(default_factory=list)  # partial hits: (seq, cached block, its own)
    launch: int = 0  # the backend's number of the launch that carried it (set by the engine)
    # perf_counter_ns at the backend call, when its output reached the host, after postprocess() (set by the
    # runner and the engine; the server's path trace reads them for a request's first token)
    t_launched: int = 0
    t_collected: int = 0
    t_processed: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)

    @property
    def kv_load(self) -> list[tuple[int, int]]:  # (host slot, device block)
        return [pair for r in self.restores for pair in r.blocks]

    @property
    def kv_copy(self) -> list[tuple[int, int]]:  # (source block, destination block)
        return [(src, dst) for _, src, dst in self.copies]

    @property
    def empty(self) -> bool:
        return not (self.items or self.kv_save or self.restores or self.copies)


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
    num_admitted: int = 0  # requests that left the waiting queue for the batch (the server's drain rate)
    oldest_waiting_ns: int = 0  # perf_counter_ns arrival of the request longest in the waiting queue (0: none)
    host_tier_blocks_total: int = 0
    host_tier_blocks_used: int = 0
    host_hit_tokens: int = 0  # prompt tokens restored from the host tier
    offloaded_blocks: int = 0  # blocks whose save to the host tier was issued
    restored_blocks: int = 0
    host_tier_evictions: int = 0
    spec_rounds: int = 0  # verify steps of speculating sequences
    spec_draft_tokens: int = 0  # drafts proposed
    spec_accepted_tokens: int = 0  # drafts accepted (the bonus token not counted)


class Scheduler:
    def __init__(self, block_manager: BlockManager, tokenizer: Tokenizer, *, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, max_waiting: int,
                 max_prefill_tokens_while_decoding: int | None = None, eos_token_ids: tuple[int, ...] = (),
                 host_tier: HostTier | None = None, drafter=None):
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        self.bm = block_manager
        self.bs = block_manager.block_size
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_while_decoding = max_prefill_tokens_while_decoding or max_num_batched_tokens
        self.max_waiting = max_waiting
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.tier = host_tier
        self.drafter = drafter  # openinfer.speculative.Drafter, or None
        self._saves: list[tuple[int, int]] = []  # sealed blocks to save, with the next batch
        self._saving: deque[ScheduledBatch] = deque()  # launched, saves not landed (launch order)
        self._loading: deque[ScheduledBatch] = deque()  # launched, restores not landed
        self._counters = dict(prefix_cache_hit_tokens=0, prefix_cache_queried_tokens=0, prompt_tokens=0,
                              prefill_tokens_computed=0, generation_tokens=0, num_finished=0, num_admitted=0, host_hit_tokens=0,
                              offloaded_blocks=0, restored_blocks=0, spec_rounds=0, spec_draft_tokens=0,
                              spec_accepted_tokens=0)

    # ---- requests ----
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int) -> Sequence:
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        k = self.drafter.num_tokens if self.drafter is not None and self.drafter.serves(params) else 0
        span = max(k, self.drafter.lookahead) if k else 0  # positions a round may write past the last
        pool_tokens = self.bm.num_usable * self.bs - span
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
        seq = Sequence(request_id, list(prompt_token_ids), params, seed, max_len, self.bs, detok, k, span)
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
    def schedule(self, prev: ScheduledBatch | None = None) -> ScheduledBatch:
        """The next step: decode rows first (one token each), then the next chunk of every prompt under
        way, in admission order, then admissions from the head of the queue, under the token budget.

        With `prev` (overlapped steps), the step after prev, scheduled while prev runs, before its
        postprocess(): what schedule() would return once prev is done, except that a row whose input is
        prev's sampled token takes it on the device (feed_row: prev's output row; these rows come first,
        at their own index, as the backend wants). A sequence that stops on prev's token (EOS, a stop
        string) wastes its row: postprocess() skips rows of finished sequences; one that prev's token
        ends by length gets none. Admission sees the pool before prev's postprocess, so a request may
        wait one step longer, never shorter."""
        batch, budget = ScheduledBatch(), self.max_num_batched_tokens
        done: dict[int, int] = {}  # id(seq) -> tokens computed once prev has run
        if prev is None:
            for seq in self.running:
                if seq.num_computed >= seq.num_prompt and not seq.restoring:
                    # a speculating sequence verifies [anchor, drafts] (drafts never run past max_len)
                    drafts = seq.drafts[:max(0, seq.max_len - len(seq.token_ids) - 1)]
                    batch.items.append(ScheduledSeq(seq, seq.num_computed, 1 + len(drafts), True, drafts=drafts))
                    budget -= 1 + len(drafts)
        else:
            row = 0
            for it in prev.items:
                seq, r = it.seq, row
                row += it.sample
                if seq.status is not Status.RUNNING:
                    continue
                done[id(seq)] = it.start + it.num_tokens
                if it.sample and len(seq.token_ids) + 1 < seq.max_len:
                    batch.items.append(ScheduledSeq(seq, it.start + it.num_tokens, 1, True, feed_row=r))
                    budget -= 1
        if batch.items:  # decode rows: what prompts add to this step delays each of their next tokens
            budget = min(budget, self.max_prefill_while_decoding)
        for seq in self.running:  # prompts under way, in admission order
            start = done.get(id(seq), seq.num_computed)
            if start < seq.num_prompt and budget > 0 and not seq.restoring:
                budget -= self._add_chunk(batch, seq, budget, start)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, batch):
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            if not seq.restoring:
                budget -= self._add_chunk(batch, seq, budget, seq.num_computed)
        if prev is None and not batch.items and batch.restores:
            # Nothing else runs: the restored prompts' next chunks go in this launch, their layers waiting on
            # the device for the copies (the forward trails the link) instead of a step after the host sees
            # them land. With anything else in the step it would wait too: then restores land first.
            # A prompt's last token alone stays out: it runs once the copies have landed, as the one-token step
            # its cold run ran (at batch 1 a decode graph, which cannot wait on the copies layer by layer), so
            # that a restore gives the cold run's bits.
            for r in batch.restores:
                seq = r.seq
                if budget > 0 and seq.num_computed < seq.num_prompt and not self._last_token_alone(seq, seq.num_computed):
                    budget -= self._add_chunk(batch, seq, budget, seq.num_computed)
            batch.kv_load_wait = bool(batch.items)
        in_backend = self.drafter is not None and self.drafter.in_backend
        for it in batch.items:  # lazy allocation: always succeeds thanks to the promises
            it.draft = in_backend and it.seq.spec_k > 0 and it.num_rows > 0
            # a backend drafter writes its block's K/V past the step's tokens (its own pool, the same blocks)
            need = -(-(it.start + it.num_tokens + (self.drafter.lookahead if it.draft else 0)) // self.bs)
            while len(it.seq.block_table) < need:
                it.seq.block_table.append(self.bm.allocate())
        batch.kv_save, self._saves = self._saves, []
        return batch

    def _add_chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int, start: int) -> int:
        n = min(seq.num_prompt - start, budget)
        # A prompt of more than one block ends in a chunk of its last token alone: what a later prefix hit of
        # this prompt computes (its whole blocks shared, its partial tail copied: _admit). Both runs then compute
        # that token alike (a one-row step), never once inside a long chunk and once alone, whose sums round
        # differently: the same request twice gives the same tokens (issue #26 item 1). A one-token step is
        # also the cheapest last chunk (at batch 1, the persistent decode kernel).
        last = seq.num_prompt - 1
        if seq.num_prompt > self.bs and start < last < start + n:
            n = last - start
        batch.items.append(ScheduledSeq(seq, start, n, start + n == seq.num_prompt))
        self._counters["prefill_tokens_computed"] += n
        return n

    def _last_token_alone(self, seq: Sequence, start: int) -> bool:
        """Whether a chunk from `start` is the prompt's last token in a step of its own (_add_chunk)."""
        return seq.num_prompt > self.bs and start == seq.num_prompt - 1

    def promised_blocks(self) -> int:
        return sum(s.promise for s in self.running)

    def _admit(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        # A hit never covers the last prompt token: it must be recomputed to produce logits.
        max_blocks = (seq.num_prompt - 1) // self.bs
        hits = self.bm.match_prefix(seq.prompt_chain, max_blocks)
        cost = (seq.blocks_needed - len(hits)) + self.bm.num_free_among(hits)
        if cost > self.bm.num_free - self.promised_blocks():
            return False
        self.bm.acquire(hits)
        seq.block_table = list(hits)
        seq.num_sealed = len(hits)
        seq.last_hash = self.bm.blocks[hits[-1]].hash if hits else None
        seq.num_computed = seq.num_cached_tokens = len(hits) * self.bs
        slots = self.tier.match(seq.prompt_chain, len(hits), max_blocks) if self.tier is not None else []
        part, src = seq.prompt_partial, None
        if part is not None and len(hits) + len(slots) == part[0]:  # every whole block before it is a hit
            src = self.bm.match_partial(part[1], part[2], part[3])
            if src is None and self.tier is not None:
                slot = self.tier.match_partial(part[1], part[2], part[3])
                if slot is not None:
                    slots.append(slot)
        if slots:
            self._restore(seq, slots, batch)
        if src is not None:
            self._copy_partial(seq, src, batch)
        seq.status = Status.RUNNING
        seq.t_admitted = time.perf_counter_ns()  # it has its blocks and a place in this step
        self.running.append(seq)
        c = self._counters
        c["prefix_cache_queried_tokens"] += seq.num_prompt
        c["prefix_cache_hit_tokens"] += len(hits) * self.bs
        c["prompt_tokens"] += seq.num_prompt
        c["num_admitted"] += 1
        return True


    # ---- the host tier ----
    def _restore(self, seq: Sequence, slots: list[int], batch: ScheduledBatch) -> None:
        """Device blocks for the host hits (taken from the sequence's promise), filled by copy."""
        # held until the copy lands, even if the request goes first; ascending ids, so that blocks adjacent
        # in the pool and in the tier (a prefix saved in one go) move in one copy
        bids = sorted(self.bm.allocate() for _ in slots)
        self.bm.acquire(bids)
        pairs = []
        for slot, bid in zip(slots, bids):
            self.tier.pin(slot)
            pairs.append((slot, bid))
        batch.restores.append(Restore(seq, pairs, len(seq.block_table)))
        seq.block_table += [bid for _, bid in pairs]
        tail = len(self.tier.entry(slots[-1])[2])  # whole blocks, then maybe the prompt's partial tail
        full = len(slots) - (tail < self.bs)
        seq.num_sealed += full
        if full:
            seq.last_hash = self.tier.entry(slots[full - 1])[0]
        hit = (len(slots) - 1) * self.bs + tail
        seq.num_computed = seq.num_cached_tokens = seq.num_computed + hit
        seq.restoring = True
        self._counters["host_hit_tokens"] += hit
        self._counters["restored_blocks"] += len(slots)

    def _copy_partial(self, seq: Sequence, src: int, batch: ScheduledBatch) -> None:
        """A block of its own for the prompt's partial tail, filled from the cached one by a copy before the
        step's forward (StepInput.kv_copy): the sequence goes on to write the slots after the tail."""
        # From its promise. The source may be the block evicted for it (then no copy), or be evicted later in
        # this schedule() for another sequence: the copy precedes every write and load of this launch.
        dst = self.bm.allocate()
        if dst != src:
            batch.copies.append((seq, src, dst))
            self.bm.touch(src)  # used now: evicted after the blocks used less recently
        seq.block_table.append(dst)
        seq.num_computed = seq.num_cached_tokens = seq.num_prompt - 1
        self._counters["prefix_cache_hit_tokens"] += len(seq.prompt_partial[2])

    def _seal_partial(self, seq: Sequence) -> None:
        """The prompt's partial tail is computed: its block serves repeats of the prompt (and goes to the tier)."""
        i, prev, toks, h = seq.prompt_partial
        self.bm.seal_partial(seq.block_table[i], prev, toks, h)
        if self.tier is not None:
            self._offload(seq.block_table[i], h, prev, toks)

    def _offload(self, block_id: int, h: int, prev: int | None, toks) -> None:
        slot = self.tier.reserve(h, prev, toks)
        if slot is not None:  # None: the tier has it already, or every slot is in use by a copy
            self.bm.acquire([block_id])  # held until the save lands
            self._saves.append((block_id, slot))
            self._counters["offloaded_blocks"] += 1

    def launched(self, batch: ScheduledBatch) -> None:
        """The engine launched `batch` as launch number batch.launch: its copies are in flight."""
        if batch.kv_save:
            self._saving.append(batch)
        if batch.restores:
            self._loading.append(batch)

    def not_launched(self, batch: ScheduledBatch) -> None:
        """The launch of `batch` failed before its copies were issued: undo them. Saves are forgotten
        (the blocks are saved again if ever sealed again); restoring sequences recompute those blocks."""
        for bid, slot in batch.kv_save:
            self.tier.forget(slot)
            self.bm.release([bid])
        for r in batch.restores:
            for slot, bid in r.blocks:
                self.tier.unpin(slot)
                self.bm.release([bid])
            r.seq.restoring = False
            r.seq.num_computed = r.seq.num_cached_tokens = r.first * self.bs
            r.seq.num_sealed = r.first
            r.seq.last_hash = r.seq.prompt_chain.prev(r.first)
        for seq, _, _ in batch.copies:  # the copied tail is computed instead (its block stays the sequence's)
            seq.num_computed = seq.num_cached_tokens = min(seq.num_computed, seq.prompt_partial[0] * self.bs)

    def copies_in_flight(self) -> bool:
        return bool(self._saving or self._loading)

    def copies_pending(self) -> bool:
        """Saves still to issue, or copies in flight: the engine keeps stepping until none are left."""
        return bool(self._saves) or self.copies_in_flight()

    def copies_landed(self, saves_upto: int, loads_upto: int) -> None:
        """The backend's copy_progress(): release what landed copies held; restored sequences may run."""
        while self._saving and self._saving[0].launch <= saves_upto:
            for bid, slot in self._saving.popleft().kv_save:
                self.tier.landed(slot)
                self.bm.release([bid])
        while self._loading and self._loading[0].launch <= loads_upto:
            for r in self._loading.popleft().restores:
                alive = r.seq.status is Status.RUNNING
                prev = self.tier.entry(r.blocks[0][0])[1]  # the chain hash before the first restored block
                for slot, bid in r.blocks:
                    if alive:  # the bytes are on the device now: GPU prefix hits may share them
                        h, _, toks = self.tier.entry(slot)
                        if len(toks) < self.bs:  # a prompt's partial tail (the last of the restore)
                            self.bm.seal_partial(bid, prev, toks, h)
                        else:
                            prev = self.bm.seal(bid, prev, toks, h)  # the slot's hash is this chain's: no rehash
                    self.tier.unpin(slot)
                    self.bm.release([bid])
                r.seq.restoring = False

    def postprocess(self, batch: ScheduledBatch, out: StepOutput) -> list[RequestUpdate]:
        updates, row = [], 0
        try:
            for b, it in enumerate(batch.items):
                seq = it.seq
                r = row
                row += it.num_rows
                if seq.status is not Status.RUNNING:  # aborted (or finished) while the step ran
                    continue
                if it.drafts:
                    updates.append(self._commit_verified(seq, it, out, r, int(out.accepted[b])))
                    self._draft(seq, out, b)
                    continue
                seq.num_computed = it.start + it.num_tokens
                self._seal(seq)
                if seq.num_computed == seq.num_prompt - 1 and seq.prompt_partial is not None:
                    self._seal_partial(seq)
                if it.sample:
                    updates.append(self._append_token(seq, out, r))
                    self._draft(seq, out, b)
        finally:  # a finished sequence must never stay in `running`, even if a later one raised
            if any(s.status is Status.FINISHED for s in self.running):
                self.running = [s for s in self.running if s.status is Status.RUNNING]
        return updates

    # ---- speculative decoding ----
    def _commit_verified(self, seq: Sequence, it: ScheduledSeq, out: StepOutput, r: int, accepted: int) -> RequestUpdate:
        """A verify of [anchor, d1..dk]: the first `accepted` rows' tokens are the target's own (d1.. up to the
        first mismatch, then its token there), so they are kept, one by one through the stop checks; the K/V
        of the anchor and the kept drafts stay, the rest is rolled back (the length moves back; those slots
        are written again later)."""
        c = self._counters
        c["spec_rounds"] += 1
        c["spec_draft_tokens"] += len(it.drafts)
        c["spec_accepted_tokens"] += accepted - 1
        merged = None
        for j in range(accepted):  # as plain decode steps would: the K/V up to the row's position, then its token
            seq.num_computed = it.start + j + 1
            self._seal(seq)
            u = self._append_token(seq, out, r + j)
            merged = u if merged is None else merged.extend(u)
            if u.finished:
                break
        return merged

    def _draft(self, seq: Sequence, out: StepOutput, b: int) -> None:
        """The next round's proposals, once the sequence has its first token and goes on: from the step's
        output (a drafter in the backend) or from the drafter itself."""
        if not seq.spec_k or seq.status is not Status.RUNNING:
            return
        if self.drafter.in_backend:
            seq.drafts = [int(t) for t in out.drafts[b] if t >= 0][:seq.spec_k]
        else:
            seq.drafts = list(self.drafter.propose(seq))[:seq.spec_k]

    def _seal(self, seq: Sequence) -> None:
        chain = seq.prompt_chain
        while (seq.num_sealed + 1) * self.bs <= seq.num_computed:
            i = seq.num_sealed
            prev = seq.last_hash
            if i < len(chain.blocks) and prev == chain.prev(i):  # a prompt block: its hash is known
                toks, h = chain.blocks[i], chain.hashes[i]
            else:
                toks, h = seq.token_ids[i * self.bs:(i + 1) * self.bs], None
            seq.last_hash = self.bm.seal(seq.block_table[i], prev, toks, h)
            if self.tier is not None:
                self._offload(seq.block_table[i], seq.last_hash, prev, toks)
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
        text, reason = next_text(seq.detok, tok, p, self.eos_token_ids, len(seq.token_ids) >= seq.max_len)
        if reason is not None:
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

    def check_integrity(self) -> None:
        """Raises AssertionError when the bookkeeping is inconsistent: the block manager's and the host
        tier's own invariants, and every block's references = the sequences holding it + the copies in
        flight that hold it."""
        self.bm.check_integrity()
        refs = [0] * len(self.bm.blocks)
        for seq in self.running:
            for bid in seq.block_table:
                refs[bid] += 1
        pinned_slots: dict[int, int] = {}
        for batch in [*self._saving, *self._pending_save_batches()]:
            for bid, slot in batch.kv_save:
                refs[bid] += 1
                pinned_slots[slot] = pinned_slots.get(slot, 0) + 1
        for batch in self._loading:
            for r in batch.restores:
                for slot, bid in r.blocks:
                    refs[bid] += 1
                    pinned_slots[slot] = pinned_slots.get(slot, 0) + 1
        for b in self.bm.blocks[1:]:
            assert b.ref_count == refs[b.id], f"block {b.id}: {b.ref_count} references, {refs[b.id]} holders"
        if self.tier is not None:
            self.tier.check_integrity()
            for slot in range(self.tier.num_slots):
                assert self.tier.pins(slot) == pinned_slots.get(slot, 0), f"host slot {slot}: pins != copies"

    def _pending_save_batches(self) -> list[ScheduledBatch]:
        return [ScheduledBatch(kv_save=self._saves)] if self._saves else []

    def stats(self) -> SchedulerStats:
        t = self.tier
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              oldest_waiting_ns=self.waiting[0].t_arrived if self.waiting else 0,  # FIFO
                              kv_blocks_total=self.bm.num_usable, kv_blocks_used=self.bm.num_used,
                              kv_blocks_free=self.bm.num_free, kv_blocks_cached=self.bm.num_cached,
                              kv_blocks_promised=self.promised_blocks(),
                              host_tier_blocks_total=t.num_slots if t else 0, host_tier_blocks_used=t.num_used if t else 0,
                              host_tier_evictions=t.evictions if t else 0, **self._counters)
