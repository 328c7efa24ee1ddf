"""CUDA Graph decode: replay == the same bucket launched eagerly, for batch sizes 1..256; and
cuda_graph=False gives the same generations."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpu_util import rel_err, requires_gpu

from openinfer.step import StepInput

pytestmark = requires_gpu


def _config_dir(tmp: Path, preset: str) -> Path:
    import openinfer
    from openinfer.tools.random_checkpoint import hf_config

    d = tmp / preset
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config(preset)))
    src = Path(openinfer.__file__).parent / "data" / "qwen3-tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    return d


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import openinfer

    d = _config_dir(tmp_path_factory.mktemp("graphs"), "qwen3-4b")
    eng = openinfer.Engine(str(d), device="cuda", load_format="random", max_model_len=8192, max_num_seqs=256,
                           gpu_memory_utilization=0.45)
    yield eng
    eng.close()


def _decode_batch(backend, B, rng, next_block, lens=None):
    """Prefill B sequences of mixed lengths (or `lens`), return the arrays of one decode step over all
    of them, and the next free block."""
    if lens is None:
        lens = rng.integers(1, 700, B)
        lens[0] = 1
        if B > 1:
            lens[1] = 16  # a block edge
    lens = np.asarray(lens)
    tables, ctx = [], []
    for n in lens:
        nb = -(-(int(n) + 1) // 16)
        blocks = list(range(next_block, next_block + nb))
        next_block += nb
        ids = rng.integers(0, 151643, int(n)).astype(np.int32)
        pos = np.arange(n, dtype=np.int32)
        slots = (np.array(blocks)[pos // 16] * 16 + pos % 16).astype(np.int32)
        one = np.zeros(1, np.float32)
        backend.step(StepInput(ids, pos, np.array([0, n], np.int32), np.array([n], np.int32), np.array([blocks], np.int32),
                     slots, np.array([n - 1], np.int32), one, one + 1, np.zeros(1, np.int32), np.zeros(1, np.uint64)))
        tables.append(blocks)
        ctx.append(int(n) + 1)
    M = max(len(t) for t in tables)
    bt = np.zeros((B, M), np.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = t
    pos = np.array(ctx, np.int32) - 1
    slots = (bt[np.arange(B), pos // 16] * 16 + pos % 16).astype(np.int32)
    temp = np.where(np.arange(B) % 2 == 0, 0.0, 0.8).astype(np.float32)  # greedy and sampled rows
    args = (rng.integers(0, 151643, B).astype(np.int32), pos, np.arange(B + 1, dtype=np.int32),
            np.array(ctx, np.int32), bt, slots, np.arange(B, dtype=np.int32), temp, np.full(B, 0.9, np.float32),
            np.full(B, 50, np.int32), np.arange(B, dtype=np.uint64) + 7)
    return args, next_block


@pytest.mark.parametrize("B", [1, 2, 3, 7, 8, 9, 16, 31, 64, 100, 256])
def test_graph_replay_equals_eager(engine, B):
    backend = engine.llm_engine.backend
    assert B == 1 or max(backend.eng.graph_batches) >= B
    args, _ = _decode_batch(backend, B, np.random.default_rng(B), 1)
    before = backend.eng.graph_steps
    g = backend.step(StepInput(*args))
    assert backend.eng.graph_steps == before + 1, "the decode step did not replay a graph"
    e = backend.step(StepInput(*args, force_eager=True))
    assert backend.eng.graph_steps == before + 1
    np.testing.assert_array_equal(g.tokens, e.tokens)
    np.testing.assert_array_equal(g.logprobs, e.logprobs)


def test_cuda_graph_off_generates_the_same(tmp_path):
    """`cuda_graph=False` generates the same tokens. Both engines keep cuBLASLt's heuristic pick: with
    start-up autotuning, two engines may time different algorithms for a shape (batch 3-4 decode runs
    through cuBLASLt) and differ in the last bits. Within one engine, graph == eager is exact
    (test_graph_replay_equals_eager, autotuned)."""
    import openinfer

    params = openinfer.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    d = _config_dir(tmp_path, "qwen3-4b")
    out, graph_steps = [], []
    for graph in (True, False):
        eng = openinfer.Engine(str(d), device="cuda", load_format="random", max_model_len=4096, max_num_seqs=64,
                               num_kv_blocks=512, cuda_graph=graph, gemm_autotune=False)
        try:
            for prompts in (["The capital of France is", "def f(x):", "1, 2, 3,"], ["Once upon a time"]):
                out.append([o.token_ids for o in eng.generate(prompts, params)])
            graph_steps.append(eng.llm_engine.backend.eng.graph_steps)
        finally:
            eng.close()
    assert graph_steps[0] > 0 and graph_steps[1] == 0
    assert out[:2] == out[2:]


@pytest.mark.parametrize("B", [1, 3, 8, 64, 256])
def test_pdl_graph_equals_plain_eager(engine, B):
    """Programmatic dependent launch lets each kernel start before the previous one ends; every kernel
    waits for its inputs, so a graph captured with PDL matches the same step launched eagerly without it,
    bit for bit. (Within one engine: two engines may time different cuBLASLt algorithms at start-up.)
    Up to 8 rows the decode attention is launched early too and requests the K/V tiles of earlier
    steps before its wait: a tile holding this step's key read too soon would show here."""
    backend = engine.llm_engine.backend
    assert backend.eng.pdl, "the H200 runs with PDL by default"
    args, _ = _decode_batch(backend, B, np.random.default_rng(100 + B), 1)
    before = backend.eng.graph_steps
    g = backend.step(StepInput(*args))
    assert backend.eng.graph_steps == before + 1
    backend.eng.pdl = False
    try:
        e = backend.step(StepInput(*args, force_eager=True))
    finally:
        backend.eng.pdl = True
    np.testing.assert_array_equal(g.tokens, e.tokens)
    np.testing.assert_array_equal(g.logprobs, e.logprobs)


def test_pdl_eager_steps_equal_plain(engine):
    """Eager steps with PDL on and off give the same bits: prefills of 700 tokens (cuBLASLt, with the
    element-wise kernels after it) and of 3 tokens (the fused GEMV), two sequences in one step, logits
    of every sampled row compared. Each pair rewrites the same KV blocks, so the second run of a pair
    sees what the first saw."""
    backend = engine.llm_engine.backend
    rng = np.random.default_rng(11)
    for lens in ((700,), (3,), (5, 300)):
        ids, pos, slots, bt, qsl, ctx, nb = [], [], [], [], [0], [], 1
        for n in lens:
            blocks = list(range(nb, nb + -(-n // 16)))
            nb += len(blocks)
            ids.append(rng.integers(0, 151643, n).astype(np.int32))
            p = np.arange(n, dtype=np.int32)
            pos.append(p)
            slots.append((np.array(blocks)[p // 16] * 16 + p % 16).astype(np.int32))
            bt.append(blocks)
            qsl.append(qsl[-1] + n)
            ctx.append(n)
        table = np.zeros((len(lens), max(len(b) for b in bt)), np.int32)
        for i, b in enumerate(bt):
            table[i, :len(b)] = b
        S = len(lens)
        args = (np.concatenate(ids), np.concatenate(pos), np.array(qsl, np.int32), np.array(ctx, np.int32), table,
                np.concatenate(slots), np.array(qsl[1:], np.int32) - 1, np.zeros(S, np.float32),
                np.ones(S, np.float32), np.zeros(S, np.int32), np.zeros(S, np.uint64))
        outs = []
        for on in (True, False):
            backend.eng.pdl = on
            try:
                outs.append(backend.step(StepInput(*args, return_logits=True)))
            finally:
                backend.eng.pdl = True
        np.testing.assert_array_equal(outs[0].tokens, outs[1].tokens)
        np.testing.assert_array_equal(outs[0].logits, outs[1].logits)


@pytest.mark.parametrize("B,lens,kernel", [
    (1, None, "key warps"), (3, None, "key warps"), (32, None, "key warps"), (64, None, "key warps"),
    (1, [2047], "key warps"), (2, [1023, 1535], "key warps"), (4, [63, 64, 1024, 3000], "key warps"),
    (1, [2047], "one warp"), (2, [1023, 1535], "one warp"), (2, [1023, 1535], "no clusters")])
def test_rope_fused_into_attention_matches_separate(engine, B, lens, kernel):
    """Decode buckets do the q/k norm, RoPE and K/V write inside attention; the same eager steps with the
    separate kernel give the same bits over three steps, each reading the K/V the steps before wrote.
    Long contexts take the merge between clusters; 63/64/1023/1535 put the newest key at a split edge;
    the last three run the one-warp kernel (clusters, then the workspace merge alone)."""
    backend = engine.llm_engine.backend
    args, next_block = _decode_batch(backend, B, np.random.default_rng(200 + B), 1, lens)
    steps = [args]
    ids, pos, qsl, ctx, bt = args[:5]
    bt = np.concatenate([bt, np.zeros((B, 1), np.int32)], axis=1)
    nb = -(-ctx // 16)  # blocks each row holds
    for k in (1, 2):  # two more positions: at most one more block per row
        p = pos + k
        for i in range(B):
            if p[i] // 16 >= nb[i]:
                bt[i, nb[i]] = next_block + i
        slots = (bt[np.arange(B), p // 16] * 16 + p % 16).astype(np.int32)
        ids = np.random.default_rng(k).integers(0, 151643, B).astype(np.int32)
        steps.append((ids, p, qsl, ctx + k, bt.copy(), slots, *args[6:]))
    outs = []
    for fused in (True, False):
        # batch 1: the decode bucket's kernels, not the persistent kernel; one warp: one-warp blocks and
        # clusters; no clusters: workspace merges only
        backend.eng.set_kernel_choice(persistent=False, fuse_rope=fused, key_warps=kernel == "key warps",
                                      cluster_cap=1 if kernel == "no clusters" else 0)
        try:
            outs.append([backend.step(StepInput(*a, force_eager=True)) for a in steps])
        finally:
            backend.eng.set_kernel_choice()
    for f, u in zip(*outs):
        np.testing.assert_array_equal(f.tokens, u.tokens)
        np.testing.assert_array_equal(f.logprobs, u.logprobs)


def _prefill_chunks(backend, n, rng, first_block, chunk=4096):
    """One sequence's n-token prompt prefilled chunk by chunk, with room for three more tokens; returns
    its block table [1, blocks]."""
    bt = np.array([list(range(first_block, first_block + -(-(n + 3) // 16)))], np.int32)
    one = np.zeros(1, np.float32)
    for p0 in range(0, n, chunk):
        m = min(chunk, n - p0)
        pos = np.arange(p0, p0 + m, dtype=np.int32)
        backend.step(StepInput(rng.integers(0, 151643, m).astype(np.int32), pos, np.array([0, m], np.int32),
                     np.array([p0 + m], np.int32), bt, (bt[0, pos // 16] * 16 + pos % 16).astype(np.int32),
                     np.array([m - 1], np.int32), one, one + 1, np.zeros(1, np.int32), np.zeros(1, np.uint64)))
    return bt


def _persistent_vs_kernels(backend, n, rng):
    """Three batch-1 decode steps after an n-token prompt, eagerly through the decode bucket, with every
    layer in the persistent kernel and kernel by kernel; each variant's later steps read the K/V its
    earlier steps wrote. Returns (error of the persistent kernel's logits against the kernel path's,
    the spread between two kernel paths that differ only in summation order: every projection's dot
    products on the tensor cores or on CUDA cores)."""
    bt = _prefill_chunks(backend, n, rng, 1)
    steps = []
    for k in range(3):
        p = np.array([n + k], np.int32)
        steps.append((rng.integers(0, 151643, 1).astype(np.int32), p, np.array([0, 1], np.int32), p + 1, bt,
                      (bt[0, p // 16] * 16 + p % 16).astype(np.int32), np.zeros(1, np.int32),
                      np.zeros(1, np.float32), np.ones(1, np.float32), np.zeros(1, np.int32), np.zeros(1, np.uint64)))
    outs = {}
    # GEMV kernels: 0 the engine's choice, 1 CUDA cores, 3 tensor cores
    for name, persistent, gemv in (("persistent", True, 0), ("kernels", False, 0), ("tensor cores", False, 3),
                                   ("cuda cores", False, 1)):
        backend.eng.set_kernel_choice(persistent=persistent, gemv=gemv)
        try:
            outs[name] = [backend.step(StepInput(*a, force_eager=True, return_logits=True)).logits for a in steps]
        finally:
            backend.eng.set_kernel_choice()
    err = max(rel_err(x, y) for x, y in zip(outs["persistent"], outs["kernels"]))
    spread = max(rel_err(x, y) for x, y in zip(outs["tensor cores"], outs["cuda cores"]))
    return err, spread


@pytest.mark.parametrize("n", [1, 15, 16, 63, 64, 65, 700, 1023, 2047, 4000, 8000])
def test_persistent_layers_match_kernels(engine, n):
    """Batch-1 decode buckets run every layer in one persistent kernel (kernels/persistent.cu). Its logits
    match the kernel-by-kernel path's within twice the spread of two valid summation orders, at contexts
    on split and block edges (splits of >= 64 keys, up to 16 per KV head, the newest key in the last)."""
    from openinfer import _engine

    assert _engine.ops.persistent_fits(2560, 9728, 32, 8, 128)
    err, spread = _persistent_vs_kernels(engine.llm_engine.backend, n, np.random.default_rng(300 + n))
    assert 0 < spread and err <= 2 * spread, (err, spread)


def test_persistent_layers_match_kernels_32k(tmp_path):
    """The same at a 32k context: 2048 keys per split."""
    import openinfer

    d = _config_dir(tmp_path, "qwen3-4b")
    # the utilization counts the whole device, and the module's engine holds 0.45 of it
    eng = openinfer.Engine(str(d), device="cuda", load_format="random", max_model_len=32768 + 64, max_num_seqs=4,
                           gpu_memory_utilization=0.85)
    try:
        err, spread = _persistent_vs_kernels(eng.llm_engine.backend, 32768 - 3, np.random.default_rng(7))
    finally:
        eng.close()
    assert 0 < spread and err <= 2 * spread, (err, spread)


def test_graph_buckets(engine):
    """Powers of two plus one step between, from 16 on (13 graphs for 256 sequences); finalize's phases, in order,
    for the start-up log."""
    eng = engine.llm_engine.backend.eng
    assert list(eng.graph_batches) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    phases = eng.finalize_seconds
    assert [k for k, _ in phases] == ["weights_drain", "activations", "profile_step", "kv_pool", "graphs"]
    assert all(v >= 0 for _, v in phases) and phases[-1][1] > 0, phases


def test_overlapped_decode_generates_the_same(engine):
    """Decode steps launched before the previous step's tokens reach the host (fed on the device from
    the graph arena) give the synchronous loop's tokens: sampled rows, mixed lengths, and stops while the
    next row is already in flight. (Each step's batch is the same in both modes here: a row's numerics
    depend on its graph bucket, and a stop seen one step late keeps a dead row in one more step.)"""
    import openinfer

    le = engine.llm_engine
    prompts = ["The capital of France is", "def f(x):", "1, 2, 3,", "Once upon a time " * 40]
    params = [openinfer.SamplingParams(max_tokens=n, temperature=t, seed=7, ignore_eos=True)
              for n, t in ((24, 0.0), (9, 0.8), (31, 0.0), (17, 0.7))]
    greedy = openinfer.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(p):
        return [(o.token_ids, o.finish_reason) for o in engine.generate(prompts, p)]

    run(greedy)  # every later run hits the prefix cache alike (a cold prefill has other GEMM shapes, roundings)
    le._overlap = False
    sync, sync_greedy = run(params), run(greedy)
    # stop each sequence on a token it has not produced before (at the same step for all when one exists;
    # a sequence repeating one token throughout gets no stop and runs to its length)
    new = lambda t, i: t[i] not in t[:i]
    common = next((i for i in range(1, 12) if all(new(t, i) for t, _ in sync_greedy)), None)
    firsts = [common if common is not None else next((i for i in range(1, 12) if new(t, i)), None)
              for t, _ in sync_greedy]
    stop_ids = [[t[i]] if i is not None else [] for (t, _), i in zip(sync_greedy, firsts)]
    stops = [openinfer.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=s)
             for s in stop_ids]
    sync_stop = run(stops)
    le._overlap = True
    before = le.stats()["overlapped_steps"]
    try:
        assert run(params) == sync, "sampled/greedy rows, length finishes"
        got = run(stops)
    finally:
        le._overlap = le.config.overlap_steps
    if common is not None:  # same stop step for all: identical batches in both modes
        assert got == sync_stop, f"stop tokens {stop_ids}: {got} != {sync_stop}"
    for (t, reason), s in zip(got, stop_ids):
        if reason == "stop":
            assert t[-1] in s and t[-1] not in t[:-1]
        else:
            assert reason == "length" and len(t) == 12 and not set(s) & set(t)
    assert le.stats()["overlapped_steps"] >= before + 29  # run(params): 30 decode steps, the first from schedule()
    assert le.stats()["kv_blocks_used"] == 0 and le.backend.eng.pending == 0


def test_fed_steps_equal_host_fed_steps(engine):
    """Steps launched behind the running one take its sampled tokens on the device. A chain of four:
    a graph decode step (three rows) feeds an eager mixed step (those rows and a new 7-token prompt),
    which feeds an eager decode step asking for top logprobs (both staging slots in flight), which feeds
    a graph decode step. Each equals the same step given its tokens on the host, bit for bit."""
    backend = engine.llm_engine.backend
    rng = np.random.default_rng(5)
    args, nxt = _decode_batch(backend, 3, rng, 1, [5, 20, 40])  # their blocks hold three more tokens each
    pos0, bt0, temp = args[1], args[4], args[7]
    prompt = rng.integers(0, 151643, 7).astype(np.int32)
    bt = np.zeros((4, bt0.shape[1]), np.int32)
    bt[:3] = bt0
    bt[3, 0] = nxt

    def slots(rows, positions):
        return np.array([bt[b, p // 16] * 16 + p % 16 for b, p in zip(rows, positions)], np.int32)

    samp = (np.resize(temp, 4).astype(np.float32), np.full(4, 0.9, np.float32), np.full(4, 50, np.int32),
            (np.arange(4) + 11).astype(np.uint64))
    p1 = (pos0 + 1).astype(np.int32)
    mixed = (np.concatenate([np.zeros(3, np.int32), prompt]), np.concatenate([p1, np.arange(7)]).astype(np.int32),
             np.array([0, 1, 2, 3, 10], np.int32), np.array([*(p1 + 1), 7], np.int32), bt,
             slots([0, 1, 2, 3, 3, 3, 3, 3, 3, 3], [*p1, *range(7)]), np.array([0, 1, 2, 9], np.int32), *samp)

    def decode(p):
        return (np.zeros(4, np.int32), p, np.arange(5, dtype=np.int32), p + 1, bt, slots(range(4), p),
                np.arange(4, dtype=np.int32), *samp)

    p2 = np.array([*(p1 + 1), 7], np.int32)
    third, fourth = decode(p2), decode(p2 + 1)
    fed3 = np.array([0, 1, 2, -1], np.int32)
    every = np.arange(4, dtype=np.int32)
    before = backend.eng.graph_steps
    backend.launch(StepInput(*args))
    backend.launch(StepInput(*mixed, prev_rows=fed3))
    got = [backend.collect()]
    backend.launch(StepInput(*third, num_logprobs=2, prev_rows=every))  # eager: two staging slots in flight
    got.append(backend.collect())
    backend.launch(StepInput(*fourth, prev_rows=every))
    got += [backend.collect(), backend.collect()]
    assert backend.eng.graph_steps == before + 2, "the first and last steps replayed graphs"
    # the same steps with the tokens given on the host: they rewrite the same K/V, so each sees what it saw
    ref = [backend.step(StepInput(*args))]
    ref.append(backend.step(StepInput(np.concatenate([ref[0].tokens.astype(np.int32), prompt]), *mixed[1:])))
    ref.append(backend.step(StepInput(ref[1].tokens.astype(np.int32), *third[1:], num_logprobs=2)))
    ref.append(backend.step(StepInput(ref[2].tokens.astype(np.int32), *fourth[1:])))
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g.tokens, r.tokens)
        np.testing.assert_array_equal(g.logprobs, r.logprobs)
    np.testing.assert_array_equal(got[2].top_ids, ref[2].top_ids)
    np.testing.assert_array_equal(got[2].top_logprobs, ref[2].top_logprobs)
    # the comparison sees a feed that did nothing: the placeholder ids give other results
    assert not np.array_equal(backend.step(StepInput(*mixed)).logprobs, ref[1].logprobs)


def test_deterministic_steps_match_the_default_and_replay_bit_for_bit(engine, tmp_path):
    """EngineConfig.deterministic (the batch-invariant GEMM at every M, segmented attention): the same weights
    give the same decode step as the default kernels within bf16 rounding at batches 3, 8 and 64, and its
    graph replay equals its eager launch bit for bit."""
    import openinfer

    d = _config_dir(tmp_path, "qwen3-4b")
    det = openinfer.Engine(str(d), device="cuda", load_format="random", max_model_len=8192, max_num_seqs=64,
                           num_kv_blocks=4096, deterministic=True)
    try:
        for B in (3, 8, 64):
            outs = []
            for eng in (engine, det):
                backend = eng.llm_engine.backend
                args, _ = _decode_batch(backend, B, np.random.default_rng(300 + B), 1)
                args = (*args[:7], np.zeros(B, np.float32), *args[8:])  # greedy rows
                outs.append(backend.step(StepInput(*args, return_logits=True)))
                if eng is det:
                    before = backend.eng.graph_steps
                    g = backend.step(StepInput(*args))
                    assert backend.eng.graph_steps == before + 1
                    e = backend.step(StepInput(*args, force_eager=True))
                    np.testing.assert_array_equal(g.tokens, e.tokens)
                    np.testing.assert_array_equal(g.logprobs, e.logprobs)
            # each bf16 path is ~1.9e-2 from fp32 at the 4B (test_gpu_model's HF comparison): two of them apart
            # by more than 1.5x that is a wrong kernel, not rounding
            assert rel_err(outs[1].logits, outs[0].logits) < 3e-2, B
    finally:
        det.close()
