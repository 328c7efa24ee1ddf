"""The CUDA engine's side of the newer step fields: host-tier block copies (bit-identical both ways,
copies-only steps, late landing seen through copy_progress), device block copies before a step's forward, a host restore generating what a GPU prefix
hit generates, and verify steps' accepted counts computed on the GPU."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gpu_util import requires_gpu

from openinfer.reference.model import accepted_counts
from openinfer.step import StepInput

pytestmark = requires_gpu


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import openinfer
    from openinfer.tools.random_checkpoint import hf_config

    d = tmp_path_factory.mktemp("contract") / "qwen3-4b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_config("qwen3-4b")))
    src = Path(openinfer.__file__).parent / "data" / "qwen3-tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    eng = openinfer.Engine(str(d), device="cuda", load_format="random", max_model_len=4096, max_num_seqs=128,
                           num_kv_blocks=600, kv_offload=True, kv_offload_host_gib=2, gemm_autotune=False)
    yield eng
    eng.close()


def _prefill(backend, n, first_block, rng):
    blocks = list(range(first_block, first_block + -(-(n + 8) // 16)))
    pos = np.arange(n, dtype=np.int32)
    bt = np.array([blocks], np.int32)
    backend.step(StepInput(
        input_ids=rng.integers(0, 151643, n).astype(np.int32), positions=pos, query_start_loc=np.array([0, n], np.int32),
        context_lens=np.array([n], np.int32), block_tables=bt, slot_mapping=(bt[0, pos // 16] * 16 + pos % 16).astype(np.int32),
        sample_idx=np.array([n - 1], np.int32), temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32),
        top_k=np.zeros(1, np.int32), seeds=np.zeros(1, np.uint64)))
    return blocks


def _copies(save=(), load=()) -> StepInput:
    z = np.zeros(0, np.int32)
    return StepInput(input_ids=z, positions=z, query_start_loc=np.zeros(1, np.int32), context_lens=z,
                     block_tables=np.zeros((0, 1), np.int32), slot_mapping=z, sample_idx=z,
                     temperature=np.zeros(0, np.float32), top_p=np.zeros(0, np.float32), top_k=z,
                     seeds=np.zeros(0, np.uint64), kv_save=np.array(save, np.int32).reshape(-1, 2),
                     kv_load=np.array(load, np.int32).reshape(-1, 2))


def test_block_copies_are_bit_identical(engine):
    """Saves (runs of adjacent blocks coalesce into one DMA; a lone pair stays one) and loads back into
    other blocks: every byte equal, on a copy stream of their own, landing as copy_progress() says."""
    be = engine.llm_engine.backend
    blocks = _prefill(be, 200, 1, np.random.default_rng(1))  # 13 blocks of K/V, the last partly filled
    saves = [(b, 10 + i) for i, b in enumerate(blocks[:12])] + [(blocks[12], 3)]
    be.step(_copies(save=saves))
    be.wait_copies()
    s, l = be.copy_progress()
    assert s == l and s >= 2
    for b, slot in saves:
        np.testing.assert_array_equal(be.eng.read_host_block(slot), be.eng.read_kv_block(b))
    loads = [(slot, 400 + i) for i, (_, slot) in enumerate(saves)]
    be.step(_copies(load=loads))
    be.wait_copies()
    for (b, _), (_, dst) in zip(saves, loads):
        np.testing.assert_array_equal(be.eng.read_kv_block(dst), be.eng.read_kv_block(b))
    st = be.copy_stats()
    assert st["saved_bytes"] >= 13 * be.eng.kv_block_bytes and st["restore_seconds"] > 0


def test_copies_ride_with_a_step_and_refuse_bad_blocks(engine):
    be = engine.llm_engine.backend
    rng = np.random.default_rng(2)
    blocks = _prefill(be, 64, 100, rng)
    step = StepInput(input_ids=np.array([5], np.int32), positions=np.array([64], np.int32),
                     query_start_loc=np.array([0, 1], np.int32), context_lens=np.array([65], np.int32),
                     block_tables=np.array([blocks], np.int32),
                     slot_mapping=np.array([blocks[4] * 16], np.int32), sample_idx=np.array([0], np.int32),
                     temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32), top_k=np.zeros(1, np.int32),
                     seeds=np.zeros(1, np.uint64), kv_save=np.array([[blocks[0], 50], [blocks[1], 51]], np.int32))
    be.step(step)  # a decode step (a graph bucket) carrying two saves of blocks earlier steps wrote
    be.wait_copies()
    for b, slot in ((blocks[0], 50), (blocks[1], 51)):
        np.testing.assert_array_equal(be.eng.read_host_block(slot), be.eng.read_kv_block(b))
    nh = be.num_host_blocks
    for pairs in ([[0, 0]], [[be.num_kv_blocks, 0]], [[1, nh]]):
        with pytest.raises(ValueError, match="out of range"):
            be.step(replace(step, kv_save=np.array(pairs, np.int32)))
    assert be.eng.pending == 0


@pytest.mark.parametrize("layout", ["adjacent", "scattered"])
def test_a_chunk_reads_its_restore_in_the_same_launch(engine, layout):
    """kv_load_wait: a 2,048-token prefix loaded from the host and a 5-token chunk that attends to it, in one
    launch; the loads go layer group by layer group (adjacent blocks: one DMA per layer; 128 scattered ones:
    4 groups of 9 layers, a DMA per block each) and layer l waits for its group. The logits equal those of the same chunk over the blocks
    the prefix was computed in, bit for bit."""
    be = engine.llm_engine.backend
    rng = np.random.default_rng(5)
    src = _prefill(be, 2048, 1, rng)  # blocks 1..129: the prefix's 128 and the chunk's
    be.step(_copies(save=[(b, i) for i, b in enumerate(src[:128])]))
    be.wait_copies()
    dst = list(range(300, 428)) if layout == "adjacent" else list(range(599, 471, -1))
    chunk = rng.integers(0, 151643, 5).astype(np.int32)
    pos = np.arange(2048, 2053, dtype=np.int32)

    def step(prefix_blocks, tail, **kw):
        bt = np.array([prefix_blocks + [tail]], np.int32)
        return be.step(StepInput(
            input_ids=chunk, positions=pos, query_start_loc=np.array([0, 5], np.int32),
            context_lens=np.array([2053], np.int32), block_tables=bt, slot_mapping=(tail * 16 + pos % 16).astype(np.int32),
            sample_idx=np.arange(5, dtype=np.int32), temperature=np.zeros(5, np.float32), top_p=np.ones(5, np.float32),
            top_k=np.zeros(5, np.int32), seeds=np.zeros(5, np.uint64), return_logits=True, **kw))
    want = step(src[:128], src[128]).logits
    waits = be.copy_stats()["layer_waits"]
    got = step(dst, 440 if layout == "adjacent" else 460, kv_load=np.array([(i, b) for i, b in enumerate(dst)], np.int32),
               kv_load_wait=True).logits
    np.testing.assert_array_equal(got, want)
    assert be.copy_stats()["layer_waits"] - waits == 36  # every layer of the forward waited for its group
    be.wait_copies()
    for i in (0, 77, 127):
        np.testing.assert_array_equal(be.eng.read_kv_block(dst[i]), be.eng.read_kv_block(src[i]))


@pytest.mark.parametrize("graph", [False, True])
def test_device_copies_land_before_the_forward(engine, graph):
    """kv_copy (a prompt's partial tail copied from the prefix cache into a block of its own): whole blocks
    copied on the step's stream before its forward, so a one-token step that reads the copy in the same launch
    gets what it gets over the original block, bit for bit: its logits eagerly, its token and log-prob as a
    decode graph replay. Every byte of the copy equals the source's; blocks out of range are refused."""
    be = engine.llm_engine.backend
    rng = np.random.default_rng(7)
    src = _prefill(be, 45, 560, rng)  # blocks 560..563; positions 32..44 in 562
    tok = np.array([77], np.int32)

    def step(blocks, **kw):
        return be.step(StepInput(
            input_ids=tok, positions=np.array([45], np.int32), query_start_loc=np.array([0, 1], np.int32),
            context_lens=np.array([46], np.int32), block_tables=np.array([blocks], np.int32),
            slot_mapping=np.array([blocks[2] * 16 + 13], np.int32), sample_idx=np.array([0], np.int32),
            temperature=np.zeros(1, np.float32), top_p=np.ones(1, np.float32), top_k=np.zeros(1, np.int32),
            seeds=np.zeros(1, np.uint64), return_logits=not graph, **kw))
    want = step(src)
    steps = be.eng.graph_steps
    got = step([src[0], src[1], 590, src[3]], kv_copy=np.array([[src[2], 590]], np.int32))
    assert (be.eng.graph_steps > steps) == graph
    if graph:
        assert got.tokens.tolist() == want.tokens.tolist() and got.logprobs.tobytes() == want.logprobs.tobytes()
    else:
        np.testing.assert_array_equal(got.logits, want.logits)
    np.testing.assert_array_equal(be.eng.read_kv_block(590), be.eng.read_kv_block(src[2]))
    for pairs in ([[0, 590]], [[src[2], be.num_kv_blocks]]):
        with pytest.raises(ValueError, match="out of range"):
            step(src, kv_copy=np.array(pairs, np.int32))
    assert be.eng.pending == 0


def test_host_restore_generates_what_a_gpu_hit_generates(engine):
    """A prompt served cold (its blocks and its partial tail saved), then as a GPU prefix hit, then, with the
    GPU prefix cache dropped, restored from the host tier: the last two copy the same K/V bytes and all three
    compute the last token in the same one-token step, so tokens and log-probs are identical, bit for bit."""
    import openinfer

    le = engine.llm_engine
    ids = list(np.random.default_rng(3).integers(0, 151643, 700))
    sp = openinfer.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)

    def gen():
        o = engine.generate([ids], sp)[0]
        return o.token_ids, [lp.logprob for lp in o.logprobs]
    cold = gen()
    hit = gen()
    before = le.stats()
    assert before["prefix_cache_hit_tokens"] >= 699
    le.block_manager.reset_prefix_cache()
    restored = gen()
    after = le.stats()
    # 43 full blocks and the partial tail of 11 tokens: all but the last token
    assert after["host_hit_tokens"] - before["host_hit_tokens"] == 699
    assert after["prefix_cache_hit_tokens"] == before["prefix_cache_hit_tokens"]
    assert restored == hit == cold
    le.scheduler.check_integrity()
    assert after["kv_blocks_used"] == 0


@pytest.mark.parametrize("B,k", [(1, 3), (4, 7), (16, 7)])
def test_verify_accepted_counts_on_the_gpu(engine, B, k):
    """Verify steps of [anchor, d1..dk] per sequence: the GPU's accepted counts follow the rule on the
    tokens it returns; drafts made from the target's own outputs, one more each round, are all accepted
    after k rounds (the test drafter of a lossless loop)."""
    be = engine.llm_engine.backend
    rng = np.random.default_rng(B * 10 + k)
    prefix = [int(n) for n in rng.integers(20, 200, B)]  # cached tokens; the anchor comes at position n
    seqs = [_prefill(be, n, 200 + 20 * i, rng) for i, n in enumerate(prefix)]  # room for 8 more tokens
    drafts = rng.integers(0, 151643, (B, k)).astype(np.int32)
    anchors = rng.integers(0, 151643, B).astype(np.int32)
    for rnd in range(k + 1):
        ids, pos, qsl, slots, bt = [], [], [0], [], np.zeros((B, max(len(s) for s in seqs)), np.int32)
        for b, s in enumerate(seqs):
            p0 = prefix[b]
            ids += [anchors[b], *drafts[b]]
            p = np.arange(p0, p0 + k + 1)
            pos += list(p)
            bt[b, :len(s)] = s
            slots += [s[q // 16] * 16 + q % 16 for q in p]
            qsl.append(qsl[-1] + k + 1)
        S = B * (k + 1)
        step = StepInput(input_ids=np.array(ids, np.int32), positions=np.array(pos, np.int32),
                         query_start_loc=np.array(qsl, np.int32),
                         context_lens=np.array([prefix[b] + k + 1 for b in range(B)], np.int32), block_tables=bt,
                         slot_mapping=np.array(slots, np.int32), sample_idx=np.arange(S, dtype=np.int32),
                         temperature=np.zeros(S, np.float32), top_p=np.ones(S, np.float32),
                         top_k=np.zeros(S, np.int32), seeds=np.zeros(S, np.uint64), verify=True)
        out = be.step(step)
        want = accepted_counts(step.input_ids, step.query_start_loc, step.sample_idx, out.tokens)
        np.testing.assert_array_equal(out.accepted, want)
        assert (out.accepted >= min(rnd + 1, k + 1)).all(), (rnd, out.accepted)
        t = out.tokens.reshape(B, k + 1)
        if rnd < k:
            drafts[:, rnd] = t[:, rnd]  # the target's token after the accepted prefix becomes the next draft
    assert (out.accepted == k + 1).all()
