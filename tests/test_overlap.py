"""Overlapped steps: step N+1 (decode rows, prompt chunks, admissions) launched before step N's tokens
reach the host (fed on the device). Outputs must equal the synchronous loop's in every finish path,
and no KV block may leak."""
from dataclasses import replace

import numpy as np
import pytest

from openinfer import Engine, EngineConfig, LLMEngine, SamplingParams
from openinfer.block_manager import BlockManager
from openinfer.runner import pack
from openinfer.step import StepInput
from openinfer.scheduler import ScheduledBatch, Scheduler

PROMPTS = ["The capital of France is", "def f(x):", "1, 2, 3,", "Hello world, here is a longer prompt that spans "
           "more than one block of tokens"]


@pytest.fixture(scope="module")
def pair(tiny_dir):
    mk = lambda overlap: Engine(str(tiny_dir), device="cpu", num_kv_blocks=96, overlap_steps=overlap)
    return mk(True), mk(False)


def _outs(engine, params):
    return [(o.token_ids, o.text, o.finish_reason) for o in engine.generate(PROMPTS, params)]


def _used(engine):
    return engine.llm_engine.stats()["kv_blocks_used"]


def test_same_outputs_greedy_and_sampled(pair):
    on, off = pair
    before = on.llm_engine.stats()["overlapped_steps"]
    for params in (SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                   [SamplingParams(temperature=0.9, top_p=0.9, seed=s, max_tokens=m, ignore_eos=True)
                    for s, m in zip(range(4), (1, 2, 17, 33))]):
        assert _outs(on, params) == _outs(off, params)
    lp0 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)  # overlapped too
    a, b = on.generate(PROMPTS, lp0), off.generate(PROMPTS, lp0)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert np.allclose([lp.logprob for o in a for lp in o.logprobs], [lp.logprob for o in b for lp in o.logprobs],
                       rtol=0, atol=1e-4)
    assert on.llm_engine.stats()["overlapped_steps"] > before + 26
    assert off.llm_engine.stats()["overlapped_steps"] == 0
    assert _used(on) == 0 and _used(off) == 0


def test_stops_mid_overlap(pair):
    """A sequence that stops on a token (stop id, stop string) while its next row is already in
    flight: same output, the extra row is dropped, its blocks come back."""
    on, off = pair
    ref = off.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop_ids = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[o.token_ids[4]]) for o in ref]
    assert _outs(on, stop_ids) == _outs(off, stop_ids)
    assert all(len(t) <= 5 for t, _, _ in _outs(on, stop_ids))
    text = ref[1].text
    stop_str = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[text[len(text) // 2:][:3]])]
    stop_str = stop_str * len(PROMPTS)
    assert _outs(on, stop_str) == _outs(off, stop_str)
    assert _used(on) == 0


def test_logprobs_and_arrivals_overlapped(tiny_dir):
    """A request asking for top logprobs and requests arriving mid-decode: admitted into the step
    launched behind the running one, with the same tokens as the synchronous loop."""
    runs = {}
    for overlap in (True, False):
        eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=64, overlap_steps=overlap))
        eng.add_request("a", eng.tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=10,
                                                                               ignore_eos=True))
        toks, lps = {"a": [], "b": [], "c": []}, []
        for i in range(200):
            if i == 4:
                eng.add_request("b", eng.tokenizer.encode(PROMPTS[1]),
                                SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
            if i == 5:
                eng.add_request("c", eng.tokenizer.encode(PROMPTS[3]), SamplingParams(temperature=0.0, max_tokens=7,
                                                                                      ignore_eos=True))
            for u in eng.step():
                toks[u.request_id] += u.new_token_ids
                if u.request_id == "b":
                    lps += [(lp.token_id, lp.logprob, *[v for _, v in lp.top]) for lp in u.logprobs]
            if i > 5 and not eng.has_unfinished():
                break
        assert eng.stats()["kv_blocks_used"] == 0 and eng.stats()["num_running"] == 0
        runs[overlap] = (toks, eng.stats()["overlapped_steps"], lps)
    assert runs[True][0] == runs[False][0]
    # b's logprobs; fp32 sums differ slightly with the batch around b
    assert len(runs[True][2]) == 6 and np.allclose(runs[True][2], runs[False][2], rtol=0, atol=1e-4)
    assert [len(v) for v in runs[True][0].values()] == [10, 6, 7]
    assert runs[True][1] > 0


def test_abort_while_in_flight(tiny_dir, pair):
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=64))
    for rid, p in zip("ab", PROMPTS):
        eng.add_request(rid, eng.tokenizer.encode(p), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    got = {"a": [], "b": []}
    for _ in range(5):  # the prefill goes out; then each call launches the next step and collects tokens 1..4
        for u in eng.step():
            got[u.request_id] += u.new_token_ids
    assert eng._inflight is not None and len(got["a"]) == 4
    assert eng.abort_request("a")  # its row of the step in flight is dropped
    while eng.has_unfinished():
        for u in eng.step():
            got[u.request_id] += u.new_token_ids
    assert len(got["a"]) == 4
    alone = pair[1].generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    assert got["b"] == alone.token_ids
    assert eng.stats()["kv_blocks_used"] == 0 and eng._inflight is None


def test_held_updates_go_out_before_waiting(tiny_dir):
    """When no step follows (the chain ends), the caller's before_launch still runs before the wait on the
    step in flight, so the previous step's tokens are not held back a whole step."""
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=64))
    events = []
    b = eng.backend
    for name in ("launch", "collect"):
        f = getattr(b, name)
        setattr(b, name, lambda *a, _f=f, _n=name, **k: (events.append(_n), _f(*a, **k))[1])
    eng.add_request("a", eng.tokenizer.encode(PROMPTS[0]), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step(before_launch=lambda: events.append("flush"))
    collects = [i for i, e in enumerate(events) if e == "collect"]
    assert collects and all(events[i - 1] in ("flush", "launch") for i in collects)
    assert events[-2:] == ["flush", "collect"]  # the last call launched nothing


def _sched(tokenizer, num_blocks=20, max_num_seqs=4):
    bm = BlockManager(num_blocks, 16)
    return Scheduler(bm, tokenizer, max_model_len=4096, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                     max_waiting=8), bm


def _decode_batch(sched, rows):
    """Admits sequences and marks their prompts computed: `rows` = prompt lengths."""
    from openinfer.scheduler import ScheduledSeq, Status
    batch = ScheduledBatch()
    for i, n in enumerate(rows):
        seq = sched.add_request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=3), seed=0)
        sched.waiting.remove(seq)
        assert sched._admit(seq, batch)
        while len(seq.block_table) * 16 < n:
            seq.block_table.append(sched.bm.allocate())
        seq.num_computed = n - 1
        assert seq.status is Status.RUNNING
        batch.items.append(ScheduledSeq(seq, n - 1, 1, True))
    return batch


def test_schedule_after_prev_policy(tokenizer):
    sched, bm = _sched(tokenizer)
    prev = _decode_batch(sched, [16, 5])  # row 0 computes position 15: its next position opens block 2
    nxt = sched.schedule(prev)
    assert [(it.start, it.num_tokens, it.feed_row) for it in nxt.items] == [(16, 1, 0), (5, 1, 1)]
    assert len(prev.items[0].seq.block_table) == 2 and len(prev.items[1].seq.block_table) == 1
    # a sequence whose pending token reaches max_len gets no row
    prev.items[1].seq.token_ids += [7, 7]  # 5 prompt + 2 outputs: the pending third ends it by length
    assert [it.feed_row for it in sched.schedule(nxt).items] == [0]
    # an admissible waiting request joins the step launched behind the running one, after the fed rows
    sched.add_request("w", [1, 2, 3], SamplingParams(max_tokens=2), seed=0)
    both = sched.schedule(prev)
    assert [(it.start, it.num_tokens, it.feed_row, it.sample) for it in both.items] == \
        [(16, 1, 0, True), (0, 3, -1, True)]
    assert not sched.waiting


def test_schedule_after_prev_leaves_a_request_that_cannot_fit_waiting(tokenizer):
    sched, bm = _sched(tokenizer, num_blocks=6)
    prev = _decode_batch(sched, [3])
    sched.add_request("big", list(range(1, 60)), SamplingParams(max_tokens=20), seed=0)  # 5 blocks: no room now
    nxt = sched.schedule(prev)
    assert [it.feed_row for it in nxt.items] == [0] and len(sched.waiting) == 1


def test_schedule_after_prev_continues_prompt_chunks(tokenizer):
    """A chunk that leaves prompt tokens is followed by the next chunk (tokens from the host); the
    chunk that ends the prompt samples, and its token is fed into the next step's row."""
    from openinfer.scheduler import ScheduledSeq
    sched, bm = _sched(tokenizer)
    sched.max_num_batched_tokens = 8
    seq = sched.add_request("p", list(range(1, 21)), SamplingParams(max_tokens=4), seed=0)  # 20 prompt tokens
    first = sched.schedule()
    assert [(it.start, it.num_tokens, it.sample) for it in first.items] == [(0, 8, False)]
    second = sched.schedule(first)
    assert [(it.start, it.num_tokens, it.sample, it.feed_row) for it in second.items] == [(8, 8, False, -1)]
    third = sched.schedule(second)  # the prompt's last token is a chunk of its own
    assert [(it.start, it.num_tokens, it.sample) for it in third.items] == [(16, 3, False)]
    fourth = sched.schedule(third)
    assert [(it.start, it.num_tokens, it.sample, it.feed_row) for it in fourth.items] == [(19, 1, True, -1)]
    fifth = sched.schedule(fourth)
    assert [(it.start, it.num_tokens, it.feed_row) for it in fifth.items] == [(20, 1, 0)]
    args = pack(fourth, 16)
    assert list(args.input_ids) == [20] and args.prev_rows is None
    assert len(seq.block_table) == 2


def test_pack_feeds_rows(tokenizer):
    sched, bm = _sched(tokenizer)
    prev = _decode_batch(sched, [4, 9])
    sched.add_request("w", [5, 6, 7], SamplingParams(max_tokens=2), seed=0)
    args = pack(sched.schedule(prev), 16)
    assert list(args.prev_rows) == [0, 1, -1] and list(args.input_ids) == [0, 0, 5, 6, 7]
    assert list(args.positions) == [4, 9, 0, 1, 2] and list(args.query_start_loc) == [0, 1, 2, 5]
    assert pack(prev, 16).prev_rows is None


def test_reference_backend_launch_contract(tiny_dir):
    """Like the CUDA engine: a fed row is one token at its own index, fed from the step launched before."""
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=16))
    b = eng.backend
    one = dict(temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32), top_k=np.zeros(1, np.int32),
               seeds=np.zeros(1, np.uint64))
    prefill = StepInput(input_ids=np.array([5, 6, 7], np.int32), positions=np.arange(3, dtype=np.int32),
                        query_start_loc=np.array([0, 3], np.int32), context_lens=np.array([3], np.int32),
                        block_tables=np.array([[1]], np.int32), slot_mapping=np.array([16, 17, 18], np.int32),
                        sample_idx=np.array([2], np.int32), **one)
    decode = StepInput(input_ids=np.array([0], np.int32), positions=np.array([3], np.int32),
                       query_start_loc=np.array([0, 1], np.int32), context_lens=np.array([4], np.int32),
                       block_tables=np.array([[1]], np.int32), slot_mapping=np.array([19], np.int32),
                       sample_idx=np.array([0], np.int32), **one)
    first = b.step(prefill)
    b.launch(replace(decode, prev_rows=np.array([0], np.int32)))  # fed from the prefill's sampled token
    fed = b.collect()
    assert fed.tokens[0] == b.step(replace(decode, input_ids=first.tokens.astype(np.int32))).tokens[0]
    with pytest.raises(ValueError, match="prev_rows"):  # row 0 is three tokens, not one
        b.launch(replace(prefill, prev_rows=np.array([0], np.int32)))
    with pytest.raises(ValueError, match="prev_rows"):  # the previous step sampled one row
        b.launch(replace(decode, prev_rows=np.array([1], np.int32)))


def _workload(seed, max_model_len, stop_pool):
    """Ten requests arriving over time: short and long prompts, shared prefixes, max_tokens None or
    short, greedy and sampled, stop ids drawn from the model's own outputs."""
    rng, stop_rng = np.random.default_rng(seed), np.random.default_rng(seed + 1000)  # stops do not shift the rest
    reqs, first = [], None
    for i in range(10):
        ids = rng.integers(5, 1000, int(rng.integers(1, 40))).tolist()
        if first is not None and rng.random() < 0.3:
            ids = first[:20] + ids[:5]
        first = first or ids
        ids = ids[:max_model_len - 2]
        mt = [None, 1, 2, 3, 5, 17, 30][int(rng.integers(7))]
        if mt is not None:
            mt = max(1, min(mt, max_model_len - len(ids)))
        stops = stop_rng.choice(stop_pool, 3).tolist() if len(stop_pool) and stop_rng.random() < 0.7 else []
        params = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=i, max_tokens=mt,
                                stop_token_ids=stops, ignore_eos=bool(rng.random() < 0.5))
        reqs.append((f"r{i}", ids, params, int(rng.integers(0, 30))))
    return sorted(reqs, key=lambda r: r[3])


def _drive(tiny_dir, overlap, reqs, num_blocks, max_model_len, aborts=()):
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", num_kv_blocks=num_blocks, overlap_steps=overlap,
                                 max_model_len=max_model_len, max_num_seqs=4, max_num_batched_tokens=64))
    toks, reasons, todo = {r[0]: [] for r in reqs}, {}, list(reqs)
    for i in range(5000):
        if not todo and not eng.has_unfinished():
            break
        while todo and todo[0][3] <= i:
            rid, ids, params, _ = todo.pop(0)
            eng.add_request(rid, ids, params)
        for rid, at in aborts:
            if at == i:
                eng.abort_request(rid)
        for u in eng.step():
            toks[u.request_id] += u.new_token_ids
            if u.finished:
                reasons[u.request_id] = u.finish_reason
        s, bm = eng.scheduler, eng.block_manager  # the books balance after every step
        bm.check_integrity()
        assert bm.num_free >= s.promised_blocks()
        assert all(len(q.block_table) <= q.blocks_needed for q in s.running)
    assert not eng.has_unfinished() and eng.stats()["kv_blocks_used"] == 0
    return toks, reasons, eng.stats()["overlapped_steps"]


@pytest.mark.parametrize("seed,num_blocks,max_model_len", [(0, 12, 64), (1, 9, 40), (2, 40, 128)])
def test_random_workloads(tiny_dir, seed, num_blocks, max_model_len):
    """Small pools (requests wait for admission), arrivals mid-decode, stops on the model's own tokens:
    overlapped == synchronous; with aborts mid-flight nothing leaks."""
    base = _drive(tiny_dir, False, _workload(seed, max_model_len, []), num_blocks, max_model_len)
    pool = sorted({t for v in base[0].values() for t in v[1:6]})
    reqs = _workload(seed, max_model_len, pool)
    on, off = (_drive(tiny_dir, ov, reqs, num_blocks, max_model_len) for ov in (True, False))
    assert on[:2] == off[:2] and on[2] > 0 and off[2] == 0
    assert "stop" in on[1].values()
    _drive(tiny_dir, True, reqs, num_blocks, max_model_len, aborts=[("r1", 10), ("r3", 15), ("r5", 22), ("r7", 31)])
