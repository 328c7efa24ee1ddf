"""CUDA graphs for speculative rounds (issue #24): a verify step of B sequences x [anchor, d1..dk] with every
sequence drafting replays its bucket's graph (the verify forward and the drafter's pass); it equals the same
bucket launched eagerly (force_eager, or cuda_graph=False) bit for bit over runs of rounds, each round's
input made from the previous round's output (anchors from the accepted counts, the drafter's proposals or a
known continuation, so that rounds accept several drafts); padding sequences leave every KV block but the
sequences' own unchanged, in both pools; other shapes stay eager; launches overlap; --deterministic rounds
equal the unpadded eager verify bit for bit."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpu_util import requires_gpu

from openinfer.drafter import write_random_drafter
from openinfer.step import StepInput

pytestmark = requires_gpu

BLOCKS = 32  # KV blocks per test sequence: prompt (< 100) + rounds + a draft block, all under 512 positions


def _target_dir(tmp: Path, preset: str) -> Path:
    """tiny: a checkpoint; others: config.json and the tokenizer only (load_format random)."""
    import openinfer
    from openinfer.tools.random_checkpoint import hf_config, write_checkpoint

    d = tmp / preset
    if preset == "tiny":
        return write_checkpoint(d, hf_config("tiny"), seed=3)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config(preset)))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(openinfer.__file__).parent / "data" / "qwen3-tokenizer" / f, d / f)
    return d


def _engine(tmp: Path, target: str, drafter: str, **kw):
    import openinfer
    from openinfer.tools.random_checkpoint import drafter_config

    d = write_random_drafter(tmp / drafter, drafter_config(drafter), seed=4)
    kw = {**dict(device="cuda", draft_model_path=str(d), max_model_len=2048, num_kv_blocks=1024, max_num_seqs=24), **kw}
    if target != "tiny":
        kw["load_format"] = "random"
    return openinfer.Engine(str(_target_dir(tmp, target)), **kw)


@pytest.fixture(scope="module", params=[("tiny", "tiny-dspark"), ("tiny", "tiny-dflash"),
                                        ("qwen3-4b", "dspark-qwen3-4b")], ids=lambda p: p[1])
def spec(request, tmp_path_factory):
    eng = _engine(tmp_path_factory.mktemp("vg"), *request.param)
    yield eng
    eng.close()


def _step(seqs, tables, verify=False, draft=True, params=None):
    """seqs: [(tokens, first position)]; every row samples when verify, else each sequence's last. params:
    per sequence (temperature, top_p, top_k, seed), repeated over its sampled rows (default greedy)."""
    ids, pos, qsl, sidx, rows = [], [], [0], [], []
    for b, (toks, p0) in enumerate(seqs):
        ids += list(toks)
        pos += list(range(p0, p0 + len(toks)))
        qsl.append(qsl[-1] + len(toks))
        n = len(toks) if verify else 1
        sidx += list(range(qsl[-1] - n, qsl[-1]))
        rows += [b] * n
    pos = np.array(pos, np.int32)
    seq = np.repeat(np.arange(len(seqs)), np.diff(qsl))
    bt = np.array(tables, np.int32)
    p = np.array([params[b] if params else (0.0, 1.0, 0, 0) for b in rows], np.float64).reshape(-1, 4)
    return StepInput(
        input_ids=np.array(ids, np.int32), positions=pos, query_start_loc=np.array(qsl, np.int32),
        context_lens=np.array([p0 + len(t) for t, p0 in seqs], np.int32), block_tables=bt,
        slot_mapping=(bt[seq, pos // 16] * 16 + pos % 16).astype(np.int32), sample_idx=np.array(sidx, np.int32),
        temperature=p[:, 0].astype(np.float32), top_p=p[:, 1].astype(np.float32), top_k=p[:, 2].astype(np.int32),
        seeds=p[:, 3].astype(np.uint64), verify=verify, draft=np.ones(len(seqs), np.int32) if draft else None)


def _params(B):
    """Greedy and sampled sequences alternately (the drafter samples with the anchor row's parameters)."""
    return [(0.0, 1.0, 0, 0) if b % 2 == 0 else (0.8, 0.9, 50, 100 + b) for b in range(B)]


class Seqs:
    """B prompts with their own blocks, prefilled by one eager step that drafts their first round; then rounds.
    Each round's input is [anchor, drafts] at the sequence's next position; afterwards the anchor is the
    token of the last accepted row and the sequence moved on by the accepted count."""

    def __init__(self, be, B, first_block=1, seed=0, prompt_lens=None, blocks=BLOCKS):
        rng = np.random.default_rng(seed)
        self.be, self.B = be, B
        lens = prompt_lens or [int(rng.integers(3, 90)) for _ in range(B)]
        self.prompts = [list(map(int, rng.integers(0, 151643, n))) for n in lens]
        self.tables = [list(range(first_block + blocks * b, first_block + blocks * (b + 1))) for b in range(B)]
        self.params = _params(B)

    def prefill(self):
        out = self.be.step(_step([(p, 0) for p in self.prompts], self.tables, params=self.params))
        self.anchor = [int(t) for t in out.tokens]
        self.drafts = out.drafts.copy()
        self.pos = [len(p) for p in self.prompts]
        self.kept = [[a] for a in self.anchor]  # the tokens each sequence kept, from the prefill's on
        return out

    def round_input(self, drafts=None):
        d = self.drafts if drafts is None else drafts
        return _step([([self.anchor[b], *map(int, d[b])], self.pos[b]) for b in range(self.B)], self.tables,
                     verify=True, params=self.params)

    def advance(self, out):
        span = len(out.tokens) // self.B
        for b in range(self.B):
            acc = int(out.accepted[b])
            self.kept[b] += [int(t) for t in out.tokens[b * span:b * span + acc]]
            self.anchor[b] = int(out.tokens[b * span + acc - 1])
            self.pos[b] += acc
        self.drafts = out.drafts.copy()

    def run(self, rounds, force_eager=False, oracle=None):
        """Prefill, then `rounds` rounds; oracle: per sequence the tokens to propose (a known continuation,
        one slot made wrong in odd sequences, so rounds accept all, some or none of their drafts)."""
        outs = [self.prefill()]
        k = self.drafts.shape[1]
        for r in range(rounds):
            drafts = None
            if oracle is not None:
                drafts = np.zeros((self.B, k), np.int32)
                for b in range(self.B):
                    i = len(self.kept[b])  # the anchor is kept[b][-1] = oracle[b][i - 1]
                    want = (oracle[b][i:i + k] + [0] * k)[:k]
                    if b % 2:
                        want[r % k] = (want[r % k] + 1) % 151643
                    drafts[b] = want
            step = self.round_input(drafts)
            step.force_eager = force_eager
            out = self.be.step(step)
            outs.append(out)
            self.advance(out)
        return outs


def _same(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    np.testing.assert_array_equal(a.accepted, b.accepted)
    np.testing.assert_array_equal(a.drafts, b.drafts)


@pytest.mark.parametrize("B", [1, 3, 8])
def test_verify_rounds_replay_equals_eager(spec, B):
    be = spec.llm_engine.backend
    cfg = spec.llm_engine.config.drafter_config
    buckets = list(be.eng.verify_graph_batches)
    assert buckets == [1, 2, 4, 8, 16], buckets  # decode buckets up to the drafter's chunk (16)
    assert list(be.eng.graph_batches) == []  # no decode graphs with a drafter
    print(f"{cfg.format} block {cfg.block_size}: verify graphs {buckets}, {be.eng.graph_bytes / (1 << 20):.1f} MiB")
    rounds = 6
    for oracle in (None, "kept"):
        cont = None
        if oracle:  # the target's own continuation, kept by the run before: rounds then accept several drafts
            cont = Seqs(be, B, seed=B)
            cont.run(3 * rounds)
            cont = cont.kept
        before = be.eng.graph_steps
        g = Seqs(be, B, seed=B).run(rounds, oracle=cont)
        assert be.eng.graph_steps == before + rounds, "a round did not replay its verify graph"
        e = Seqs(be, B, seed=B).run(rounds, force_eager=True, oracle=cont)
        assert be.eng.graph_steps == before + rounds
        for x, y in zip(g, e):
            _same(x, y)
        for out in g[1:]:
            assert out.accepted.shape == (B,) and out.drafts.shape == (B, cfg.num_drafts)
            assert ((out.accepted >= 1) & (out.accepted <= cfg.num_drafts + 1)).all()
            assert (out.drafts >= 0).all() and 0 < out.draft_ms < out.gpu_ms
        if oracle:
            # a round's first row is the recorded run's first row exactly (same anchor, position, keys)
            assert max(int(a) for out in g[1:] for a in out.accepted) >= 2, "no round accepted a draft"


def test_long_context_rounds_replay_whole_span_graphs(tmp_path):
    """max_model_len past ATTN_SHORT_ITEMS_MAX_CTX: the verify graphs come in two sets, short items (a DFlash span
    of 16 x the tiny target's group of 2 in items of 8 tokens) for rounds whose sequences hold at most that many
    keys and whole spans for longer ones (each short item reads its sequence's whole KV range). Rounds on both
    sides of the limit replay a graph and equal their eager bucket bit for bit; the buckets listed are one set's."""
    from openinfer import _engine as native

    limit = native.ops.ATTN_SHORT_ITEMS_MAX_CTX
    eng = _engine(tmp_path, "tiny", "tiny-dflash", max_model_len=2 * limit, max_num_batched_tokens=4 * limit)
    try:
        be = eng.llm_engine.backend
        assert list(be.eng.verify_graph_batches) == [1, 2, 4, 8, 16]
        span = eng.llm_engine.config.drafter_config.num_drafts + 1
        blocks = (limit + 8 * span) // 16  # the prompt, 4 rounds and a draft block
        for B in (1, 3):
            # the first round's longest context is exactly the limit (short items), the later ones past it
            lens = [limit - span - 2 * (B - 1 - b) for b in range(B)]
            before = be.eng.graph_steps
            g = Seqs(be, B, seed=B, prompt_lens=lens, blocks=blocks).run(4)
            assert be.eng.graph_steps == before + 4, "a round did not replay its verify graph"
            e = Seqs(be, B, seed=B, prompt_lens=lens, blocks=blocks).run(4, force_eager=True)
            assert be.eng.graph_steps == before + 4
            for x, y in zip(g, e):
                _same(x, y)
    finally:
        eng.close()


def test_padding_sequences_touch_nothing(tmp_path):
    """Batch 3 in the 4-bucket: block 0 and blocks no sequence of the round holds (a bystander's, free ones)
    are unchanged in the target's pool and the drafter's after graph rounds, and after the same rounds eager."""
    eng = _engine(tmp_path, "tiny", "tiny-dspark")
    try:
        be = eng.llm_engine.backend
        bystander = Seqs(be, 1, first_block=1 + 3 * BLOCKS, seed=9)
        bystander.prefill()
        watch = [0, *bystander.tables[0][:8], 1 + 4 * BLOCKS, 1 + 4 * BLOCKS + 7, be.num_kv_blocks - 1]
        snap = lambda: [(be.eng.read_kv_block(b), be.eng.read_kv_block(b, drafter=True)) for b in watch]
        before = snap()
        steps = be.eng.graph_steps
        Seqs(be, 3, seed=1).run(4)
        Seqs(be, 3, seed=1).run(4, force_eager=True)
        assert be.eng.graph_steps == steps + 4
        for blk, (t0, d0), (t1, d1) in zip(watch, before, snap()):
            np.testing.assert_array_equal(t0, t1, err_msg=f"target block {blk}")
            np.testing.assert_array_equal(d0, d1, err_msg=f"drafter block {blk}")
    finally:
        eng.close()


def test_other_shapes_stay_eager(tmp_path):
    """More sequences than the largest bucket, a round with fewer drafts, logprobs, no drafting, tap layers:
    eager steps, with well-formed results."""
    eng = _engine(tmp_path, "tiny", "tiny-dspark")
    try:
        be = eng.llm_engine.backend
        many, three = Seqs(be, 17, seed=2), Seqs(be, 3, first_block=1 + 17 * BLOCKS, seed=2)
        many.prefill()
        three.prefill()
        k = three.drafts.shape[1]
        cases = {"17 sequences": many.round_input(), "fewer drafts": three.round_input(three.drafts[:, :k - 1])}
        for name, field, value in (("logprobs", "num_logprobs", 2), ("no draft", "draft", None),
                                   ("taps", "tap_layers", np.array([0], np.int32))):
            cases[name] = three.round_input()
            setattr(cases[name], field, value)
        cases["taps"].tap_rows = np.arange(3, dtype=np.int32)
        for name, step in cases.items():
            out = be.step(step)
            span = len(out.tokens) // len(out.accepted)
            assert ((out.accepted >= 1) & (out.accepted <= span)).all(), name
            assert be.eng.graph_steps == 0, f"{name}: replayed a graph"
    finally:
        eng.close()


def test_overlapped_launches_equal_single_steps(tmp_path):
    """Two graph rounds in flight (both arena images), then a graph round with an eager prefill behind it:
    each equals the same step run alone, bit for bit (they rewrite the same K/V, so each sees what it saw)."""
    eng = _engine(tmp_path, "tiny", "tiny-dspark")
    try:
        be = eng.llm_engine.backend
        a, b = Seqs(be, 3, seed=3), Seqs(be, 2, first_block=1 + 3 * BLOCKS, seed=4)
        a.prefill()
        b.prefill()
        c = Seqs(be, 1, first_block=1 + 5 * BLOCKS, seed=5)
        prefill_c = _step([(c.prompts[0], 0)], c.tables, params=c.params)
        ra, rb = a.round_input(), b.round_input()
        before = be.eng.graph_steps
        be.launch(ra)
        be.launch(rb)
        got = [be.collect(), be.collect()]
        be.launch(ra)
        be.launch(prefill_c)
        got += [be.collect(), be.collect()]
        assert be.eng.graph_steps == before + 3
        ref = [be.step(ra), be.step(rb), be.step(ra), be.step(prefill_c)]
        for x, y in zip(got, ref):
            _same(x, y)
    finally:
        eng.close()


def test_deterministic_rounds_equal_the_unpadded_verify(tmp_path):
    """--deterministic: a row's bits do not depend on its batch, so a graph round's target rows (tokens,
    logprobs, accepted counts) equal the unpadded eager verify's (taps make a step eager) bit for bit; and the
    graph equals its eager bucket, drafts included."""
    eng = _engine(tmp_path, "tiny", "tiny-dspark", deterministic=True)
    try:
        be = eng.llm_engine.backend
        for B in (1, 3):
            s = Seqs(be, B, seed=6)
            s.prefill()
            for _ in range(3):
                step = s.round_input()
                before = be.eng.graph_steps
                g = be.step(step)
                assert be.eng.graph_steps == before + 1
                e = be.step(StepInput(**{**vars(step), "force_eager": True}))
                _same(g, e)
                unpadded = be.step(StepInput(**{**vars(step), "tap_layers": np.array([0], np.int32),
                                                "tap_rows": np.zeros(1, np.int32)}))
                assert be.eng.graph_steps == before + 1
                np.testing.assert_array_equal(g.tokens, unpadded.tokens)
                np.testing.assert_array_equal(g.logprobs, unpadded.logprobs)
                np.testing.assert_array_equal(g.accepted, unpadded.accepted)
                s.advance(g)
    finally:
        eng.close()


def test_cuda_graph_off_generates_the_same(tmp_path):
    """Speculative generation with and without the verify graphs: the same tokens (both engines keep
    cuBLASLt's heuristic pick: start-up autotuning may time different algorithms in two engines)."""
    import openinfer

    rng = np.random.default_rng(8)
    prompts = [list(map(int, rng.integers(0, 151643, int(rng.integers(3, 60))))) for _ in range(6)]
    params = [openinfer.SamplingParams(max_tokens=30, temperature=t, seed=5, ignore_eos=True) for t in (0.0, 0.8)]
    outs, graph_steps = [], []
    for graph in (True, False):
        eng = _engine(tmp_path / str(graph), "tiny", "tiny-dspark", cuda_graph=graph, gemm_autotune=False)
        try:
            outs.append([[o.token_ids for o in eng.generate(prompts, p)] for p in params])
            graph_steps.append(eng.llm_engine.backend.eng.graph_steps)
            assert eng.llm_engine.stats()["spec_rounds"] > 0
        finally:
            eng.close()
    assert graph_steps[0] > 0 and graph_steps[1] == 0
    assert outs[0] == outs[1]
