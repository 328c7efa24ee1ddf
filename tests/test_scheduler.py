"""Scheduler policy with a fake backend: admission, budgets, abort, stats."""
import numpy as np
import pytest

from openinfer.block_manager import BlockManager
from openinfer.runner import pack
from openinfer.sampling_params import SamplingParams
from openinfer.scheduler import QueueFull, RequestRejected, Scheduler
from openinfer.step import StepInput, StepOutput


class FakeBackend:
    """Echo model: the next token is the last input token + 1 (deterministic, batch-independent)."""

    def __init__(self):
        self.steps = []

    def step(self, s: StepInput) -> StepOutput:
        assert len(s.input_ids) == len(s.positions) == len(s.slot_mapping) == s.query_start_loc[-1]
        assert (s.context_lens == s.positions[s.query_start_loc[1:] - 1] + 1).all()
        self.steps.append(dict(T=len(s.input_ids), B=len(s.context_lens), S=len(s.sample_idx),
                               slots=s.slot_mapping.copy()))
        toks = (s.input_ids[s.sample_idx] + 1).astype(np.int32)
        return StepOutput(tokens=toks, logprobs=np.zeros(len(toks), np.float32))


class Run:
    """Runs a scheduled batch on the fake backend."""

    def __init__(self):
        self.backend = FakeBackend()

    def run(self, batch):
        return self.backend.step(pack(batch, 16))


class KvRun(Run):
    """Run, plus a model of the KV pool: each slot holds the (token, position) written to it; kv_copy copies
    blocks first; every sequence's attended slots must then hold its own tokens at their positions (what a
    wrong block table, a block reused under its holder or a stale copy would break)."""

    def __init__(self, num_blocks: int):
        super().__init__()
        self.kv = [None] * (num_blocks * 16)
        self.copies = 0

    def run(self, batch):
        s = pack(batch, 16)
        for src, dst in s.kv_copy:
            self.kv[dst * 16:dst * 16 + 16] = self.kv[src * 16:src * 16 + 16]
            self.copies += 1
        for t, slot in enumerate(s.slot_mapping):
            self.kv[slot] = (int(s.input_ids[t]), int(s.positions[t]))
        for b, it in enumerate(batch.items):
            for pos in range(int(s.context_lens[b])):
                slot = s.block_tables[b, pos // 16] * 16 + pos % 16
                assert self.kv[slot] == (it.seq.token_ids[pos], pos), (it.seq.request_id, pos)
        return self.backend.step(s)


def make(tokenizer, num_blocks=9, max_model_len=4096, max_num_seqs=8, budget=256, max_waiting=64):
    bm = BlockManager(num_blocks, 16)
    sched = Scheduler(bm, tokenizer, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=budget, max_waiting=max_waiting, eos_token_ids=(151645,))
    return sched, bm, Run()


def run_all(sched, bm, runner, max_steps=1000, on_step=None):
    updates = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return updates
        batch = sched.schedule()
        assert batch.items, "no progress although requests are pending"
        if on_step:
            on_step(batch)
        updates += sched.postprocess(batch, runner.run(batch))
        bm.check_integrity()
        assert bm.num_free >= sched.promised_blocks()
    raise AssertionError("did not finish")


def prompt(n, base=1000):
    return list(range(base, base + n))


def test_full_lifetime_admission_fifo(tokenizer):
    sched, bm, runner = make(tokenizer, num_blocks=9)  # 8 usable blocks = 128 tokens
    for i in range(6):  # 20 + 12 tokens = 2 blocks each: 4 fit at once
        sched.add_request(f"r{i}", prompt(20, 1000 * (i + 1)), SamplingParams(max_tokens=12), seed=0)
    first_seen, max_running = {}, 0

    def on_step(batch):
        nonlocal max_running
        max_running = max(max_running, len(sched.running))
        for it in batch.items:
            first_seen.setdefault(it.seq.request_id, len(first_seen))

    ups = run_all(sched, bm, runner, on_step=on_step)
    assert max_running == 4
    assert [r for r, _ in sorted(first_seen.items(), key=lambda kv: kv[1])] == [f"r{i}" for i in range(6)]
    done = [u for u in ups if u.finished]
    assert len(done) == 6 and all(u.finish_reason == "length" and u.num_output_tokens == 12 for u in done)
    s = sched.stats()
    assert s.num_running == s.num_waiting == 0 and s.kv_blocks_used == 0 and s.generation_tokens == 72


def test_never_fit_refused_at_once(tokenizer):
    sched, bm, runner = make(tokenizer, num_blocks=9, max_model_len=160)
    with pytest.raises(RequestRejected, match="max_model_len"):
        sched.add_request("a", prompt(100), SamplingParams(max_tokens=100), 0)
    with pytest.raises(RequestRejected, match="KV blocks"):
        sched.add_request("b", prompt(100), SamplingParams(max_tokens=40), 0)  # 140 tokens > 128 in the pool
    with pytest.raises(RequestRejected, match="no room"):
        sched.add_request("c", prompt(129), SamplingParams(), 0)
    with pytest.raises(RequestRejected, match="empty"):
        sched.add_request("d", [], SamplingParams(), 0)
    # None: capped by the pool (128 tokens of K/V; the last token is sampled, never fed back)
    sched.add_request("e", prompt(100), SamplingParams(), 0)
    ups = run_all(sched, bm, runner)
    assert ups[-1].finish_reason == "length" and ups[-1].num_output_tokens == 29
    assert not sched.has_unfinished() and sched.stats().kv_blocks_used == 0


def test_admission_counts_the_kv_of_all_but_the_last_token(tokenizer):
    """prompt + max_tokens may reach the pool's tokens + 1: the last token's K/V is never written (a
    fuzzing pass found one block reserved that a request could never use: refusals one token early,
    and a waiting request that would have fit)."""
    sched, bm, runner = make(tokenizer, num_blocks=9, max_model_len=160)  # 8 usable blocks, 128 tokens
    with pytest.raises(RequestRejected, match="needs 9 KV blocks"):
        sched.add_request("a", prompt(100), SamplingParams(max_tokens=30), 0)
    sched.add_request("b", prompt(100), SamplingParams(max_tokens=29), 0)
    sched.add_request("c", prompt(16), SamplingParams(max_tokens=1), 0)  # one block: waits for b
    ups = run_all(sched, bm, runner)
    assert [u.num_output_tokens for u in ups if u.finished] == [29, 1]
    assert sched.stats().kv_blocks_used == 0
    sched2, bm2, runner2 = make(tokenizer, num_blocks=5, max_model_len=160)  # 64 tokens
    sched2.add_request("x", prompt(16), SamplingParams(max_tokens=17), 0)  # 32 tokens of K/V: 2 blocks
    sched2.add_request("y", prompt(16), SamplingParams(max_tokens=17), 0)
    running_together = []
    run_all(sched2, bm2, runner2, on_step=lambda batch: running_together.append(len(sched2.running)))
    assert max(running_together) == 2  # before: 3 blocks each reserved, so y waited for x


def test_oldest_waiting_arrival_in_stats(tokenizer):
    """The head of the FIFO waiting queue's arrival (the server's queue-wait bound); 0 when none waits."""
    sched, *_ = make(tokenizer)
    assert sched.stats().oldest_waiting_ns == 0
    a = sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4), 0)
    sched.add_request("b", [1, 2, 3], SamplingParams(max_tokens=4), 0)
    assert sched.stats().oldest_waiting_ns == a.t_arrived > 0
    sched.abort("a")
    assert sched.stats().oldest_waiting_ns == sched.requests["b"].t_arrived
    sched.schedule()
    assert sched.stats().num_waiting == 0 and sched.stats().oldest_waiting_ns == 0


def test_queue_full(tokenizer):
    sched, *_ = make(tokenizer, max_waiting=2)
    sched.add_request("a", prompt(5), SamplingParams(max_tokens=2), 0)
    sched.add_request("b", prompt(5), SamplingParams(max_tokens=2), 0)
    with pytest.raises(QueueFull):
        sched.add_request("c", prompt(5), SamplingParams(max_tokens=2), 0)
    with pytest.raises(RequestRejected, match="already in use"):
        sched.add_request("a", prompt(5), SamplingParams(max_tokens=2), 0)


def test_abort_frees_blocks(tokenizer):
    sched, bm, runner = make(tokenizer, num_blocks=9)
    for i in range(5):
        sched.add_request(f"r{i}", prompt(30, 1000 * (i + 1)), SamplingParams(max_tokens=2), 0)
    batch = sched.schedule()
    sched.postprocess(batch, runner.run(batch))
    assert sched.stats().num_running == 4 and sched.stats().num_waiting == 1
    used = bm.num_used
    assert sched.abort("r1") and not sched.abort("r1") and not sched.abort("nope")
    # 30 tokens: the first step ran 29 (the last token is a chunk of its own), both blocks allocated
    assert bm.num_used == used - 2 and sched.promised_blocks() == 0
    assert sched.abort("r4")  # a waiting request
    bm.check_integrity()
    ups = run_all(sched, bm, runner)
    assert {u.request_id for u in ups if u.finished} == {"r0", "r2", "r3"}
    assert bm.num_used == 0


def test_budget_rows_and_chunking(tokenizer):
    sched, bm, runner = make(tokenizer, num_blocks=40, max_num_seqs=3, budget=16)
    for i in range(5):
        sched.add_request(f"r{i}", prompt(40, 1000 * (i + 1)), SamplingParams(max_tokens=5), 0)

    def on_step(batch):
        assert batch.num_tokens <= 16 and len(batch.items) <= 3
        kinds = [it.seq.num_computed >= it.seq.num_prompt for it in batch.items]
        assert kinds == sorted(kinds, reverse=True)  # decode rows come first
        for it in batch.items:
            assert it.sample == (it.start + it.num_tokens == len(it.seq.token_ids))

    ups = run_all(sched, bm, runner, on_step=on_step)
    out = {}
    for u in ups:
        out.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert out == {f"r{i}": [1000 * (i + 1) + 40 + k for k in range(5)] for i in range(5)}  # the echo model


@pytest.mark.parametrize("n, chunks", [(5, [5]), (16, [16]), (17, [16, 1]), (32, [31, 1]), (40, [39, 1]),
                                       (300, [256, 43, 1])])
@pytest.mark.parametrize("max_tokens", [2, 40])
def test_a_prompts_last_token_is_a_chunk_of_its_own(tokenizer, n, chunks, max_tokens):
    """A prompt of more than one block ends in a step of its last token alone: the step a later prefix hit
    of the same prompt runs (issue #26 item 1), so both compute that token alike. The hit shares the whole
    blocks and copies the partial tail before the last token into a block of its own (kv_copy), whether the
    first run's block filled up with generated tokens (max_tokens 40) or not."""
    sched, bm, runner = make(tokenizer, num_blocks=40, budget=256)
    sched.add_request("a", prompt(n), SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0)
    seen = []
    run_all(sched, bm, runner, on_step=lambda b: seen.extend(it.num_tokens for it in b.items
                                                             if it.start < it.seq.num_prompt))
    assert seen == chunks
    sched.add_request("b", prompt(n), SamplingParams(max_tokens=2, ignore_eos=True), 0)  # the same prompt: a hit
    seen.clear()
    copies = []

    def on_step(b):
        seen.extend((it.start, it.num_tokens) for it in b.items if it.start < it.seq.num_prompt)
        copies.extend((src, dst, seq.block_table.index(dst)) for seq, src, dst in b.copies)
    run_all(sched, bm, runner, on_step=on_step)
    assert seen == ([(n - 1, 1)] if n > 16 else [(0, n)])  # the cold run's last chunk, alone
    partial = n > 16 and (n - 1) % 16
    assert len(copies) == bool(partial) and all(i == (n - 1) // 16 for *_, i in copies)
    st = sched.stats()
    assert st.prefix_cache_hit_tokens == (n - 1 if n > 16 else 0)


def test_prompt_tokens_capped_while_requests_decode(tokenizer):
    """A prompt alone takes the whole step budget; beside decoding requests it streams in chunks of at most
    max_prefill_tokens_while_decoding, so that each of their steps stays short."""
    bm = BlockManager(64, 16)
    sched = Scheduler(bm, tokenizer, max_model_len=4096, max_num_seqs=8, max_num_batched_tokens=256,
                      max_waiting=64, max_prefill_tokens_while_decoding=40, eos_token_ids=(151645,))
    runner = Run()
    sched.add_request("a", prompt(300), SamplingParams(max_tokens=40, ignore_eos=True), 0)
    first = sched.schedule()
    assert [it.num_tokens for it in first.items] == [256]  # alone: the whole budget
    sched.postprocess(first, runner.run(first))
    sched.add_request("b", prompt(600, 5000), SamplingParams(max_tokens=4, ignore_eos=True), 0)
    seen = []

    def on_step(batch):
        decoding = [it for it in batch.items if it.seq.num_computed >= it.seq.num_prompt]
        prompt_tokens = sum(it.num_tokens for it in batch.items if it not in decoding)
        seen.append((len(decoding), prompt_tokens))
        assert prompt_tokens <= (40 if decoding else 256), (len(decoding), prompt_tokens)
    out = {}
    for u in run_all(sched, bm, runner, on_step=on_step):
        out.setdefault(u.request_id, []).extend(u.new_token_ids)
    assert out["a"] == [1300 + k for k in range(40)] and out["b"] == [5600 + k for k in range(4)]
    # while nobody decodes: a's next 43 prompt tokens and b's first 213, then a's last token and b's next 255;
    # then beside a's decode rows b's next 131 in chunks of at most 40, and b's last token alone
    assert seen[:2] == [(0, 256)] * 2 and seen[2:7] == [(1, 40)] * 3 + [(1, 11), (1, 1)], seen[:8]


def test_stop_checks(tokenizer):
    sched, bm, runner = make(tokenizer)
    hello = tokenizer.encode("Hello")
    sched.add_request("eos", [151644], SamplingParams(max_tokens=5), 0)  # echo: 151644 + 1 = EOS 151645
    sched.add_request("ign", [151644], SamplingParams(max_tokens=3, ignore_eos=True), 0)
    sched.add_request("stoptok", [500], SamplingParams(max_tokens=9, stop_token_ids=[503]), 0)
    sched.add_request("lp", hello, SamplingParams(max_tokens=2, logprobs=0), 0)
    ups = run_all(sched, bm, runner)
    fin = {u.request_id: u for u in ups if u.finished}
    assert fin["eos"].finish_reason == "stop" and fin["eos"].num_output_tokens == 1 and fin["eos"].new_text == ""
    assert fin["ign"].finish_reason == "length" and fin["ign"].num_output_tokens == 3
    assert fin["stoptok"].finish_reason == "stop" and fin["stoptok"].new_token_ids == [503]
    assert fin["lp"].logprobs[0].top == [] and fin["lp"].logprobs[0].logprob == 0.0


def test_slot_mapping_follows_block_tables(tokenizer):
    sched, bm, runner = make(tokenizer, num_blocks=20)
    sched.add_request("a", prompt(37), SamplingParams(max_tokens=3), 0)
    batch = sched.schedule()  # tokens 0..35, then the last token (a chunk of its own)
    first = pack(batch, 16)
    sched.postprocess(batch, runner.run(batch))
    batch = sched.schedule()
    last = pack(batch, 16)
    table = batch.items[0].seq.block_table
    want = [table[p // 16] * 16 + p % 16 for p in range(37)]
    assert first.slot_mapping.tolist() + last.slot_mapping.tolist() == want
    assert first.context_lens.tolist() == [36] and last.context_lens.tolist() == [37]
    assert first.sample_idx.tolist() == [] and last.sample_idx.tolist() == [0] and last.seeds.dtype == np.uint64


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [24, 64])
def test_random_traffic_under_memory_pressure(tokenizer, seed, num_blocks):
    """Arrivals with shared prefixes, repeated prompts, random lengths, aborts and a small pool: every request
    is refused at once, finishes, or is aborted; the scheduler always makes progress; every step's sequences
    read their own tokens from the KV pool (KvRun); no KV block leaks. The tiny pool (24 blocks) is the
    bottleneck; in the larger one (64) repeats find their partial tails cached."""
    rng = np.random.default_rng(seed)
    sched, bm, _ = make(tokenizer, num_blocks=num_blocks, max_model_len=200, max_num_seqs=6, budget=48,
                        max_waiting=10)
    runner = KvRun(num_blocks)
    prefixes = [prompt(int(n), base=2000 + 50 * i) for i, n in enumerate(rng.integers(1, 40, 3))]
    live, done, refused, aborted, n, max_waiting_seen, sent = set(), set(), 0, 0, 0, 0, []
    for step in range(3000):
        if n < 60 and rng.random() < 0.5:  # an arrival: a new prompt, or one sent before (partial-tail hits)
            if sent and rng.random() < 0.4:
                p = sent[int(rng.integers(len(sent)))]
            else:
                p = prefixes[rng.integers(3)] + prompt(int(rng.integers(1, 60)), base=5000 + n)
                sent.append(p)
            sp = SamplingParams(max_tokens=int(rng.integers(1, 120)), temperature=0.0, ignore_eos=True)
            try:
                sched.add_request(f"q{n}", p, sp, seed=n)
                live.add(f"q{n}")
            except (RequestRejected, QueueFull):
                refused += 1
            n += 1
        if live and rng.random() < 0.05:  # a client goes away
            rid = sorted(live)[int(rng.integers(len(live)))]
            sched.abort(rid)
            live.discard(rid)
            aborted += 1
        if not sched.has_unfinished():
            if n >= 60:
                break
            continue
        batch = sched.schedule()
        assert batch.items, "no progress although requests are pending"
        max_waiting_seen = max(max_waiting_seen, sched.stats().num_waiting)
        for u in sched.postprocess(batch, runner.run(batch)):
            if u.finished:
                live.discard(u.request_id)
                done.add(u.request_id)
        bm.check_integrity()
        assert bm.num_free >= sched.promised_blocks()
    assert not sched.has_unfinished() and not live
    assert len(done) + refused + aborted == n == 60
    if num_blocks == 24:
        assert max_waiting_seen > 0 and refused > 0  # the pool really was the bottleneck
    else:
        assert runner.copies > 0  # repeats were partial-tail hits
    assert bm.num_used == 0, "a KV block leaked"
    bm.check_integrity()


def test_postprocess_failure_leaves_no_finished_sequence_running(tokenizer):
    """A sequence that finished earlier in a postprocess that then raised must not stay in `running`
    (it would get decode rows with no blocks on every later step)."""
    from openinfer.scheduler import Status
    sched, bm, runner = make(tokenizer)
    sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1), seed=0)
    sched.add_request("b", [4, 5, 6], SamplingParams(max_tokens=5), seed=0)
    batch = sched.schedule()
    out = runner.run(batch)
    real = sched._append_token

    def fail_on_b(seq, out, r):
        if seq.request_id == "b":
            raise RuntimeError("boom")
        return real(seq, out, r)

    sched._append_token = fail_on_b
    with pytest.raises(RuntimeError, match="boom"):
        sched.postprocess(batch, out)
    sched._append_token = real
    assert [s.request_id for s in sched.running] == ["b"]
    assert all(s.status is Status.RUNNING for s in sched.running)
    assert sched.abort("b") and bm.num_used == 0


def test_a_partial_hit_not_launched_computes_its_tail(tokenizer):
    """A step refused before launch takes its partial-tail copy back: the sequence computes those tokens
    instead, into the block it already holds, and nothing leaks."""
    sched, bm, runner = make(tokenizer, num_blocks=20)
    sched.add_request("a", prompt(40), SamplingParams(max_tokens=2, ignore_eos=True), 0)
    first = run_all(sched, bm, runner)
    sched.add_request("b", prompt(40), SamplingParams(max_tokens=2, ignore_eos=True), 0)
    batch = sched.schedule()
    (seq, src, dst), = batch.copies
    assert seq.num_computed == 39 and seq.block_table[2] == dst and pack(batch, 16).kv_copy.tolist() == [[src, dst]]
    sched.not_launched(batch)
    assert seq.num_computed == 32 and seq.block_table[2] == dst
    seen = []
    again = run_all(sched, bm, runner, on_step=lambda b: seen.extend((it.start, it.num_tokens) for it in b.items))
    assert seen[:2] == [(32, 7), (39, 1)]
    assert [t for u in again for t in u.new_token_ids] == [t for u in first for t in u.new_token_ids]
    sched.check_integrity()
    assert bm.num_used == 0
