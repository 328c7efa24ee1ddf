"""Speculative decoding's loop on the NumPy backend: verify steps keep exactly the tokens plain decoding
produces (greedy and seeded sampling, whatever the drafter proposes), roll the rest back, keep every
bookkeeping invariant, and serve requests that do not speculate in the same engine."""
from __future__ import annotations

import json

import numpy as np
import pytest
from engine_util import run_requests as run

from openinfer import EngineConfig, LLMEngine, SamplingParams
from openinfer.loader import load_weights_fp32
from openinfer.reference.model import dense_forward
from openinfer.speculative import ReplayDrafter
from openinfer.tools.random_checkpoint import hf_config, write_checkpoint

V = 4096  # a small vocabulary: these tests run hundreds of steps on the NumPy backend


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec") / "small"
    write_checkpoint(d, dict(hf_config("tiny"), vocab_size=V, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32), seed=3)
    return d


def prompts_of(seed, n, lo=5, hi=60):
    rng = np.random.default_rng(seed)
    return {f"r{i}": rng.integers(5, V, int(m)).tolist() for i, m in enumerate(rng.integers(lo, hi, n))}


def engine(small_dir, drafter=None, **kw):
    return LLMEngine(EngineConfig(str(small_dir), device="cpu", **{"num_kv_blocks": 96, **kw}), drafter=drafter)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("accept", [None, 1, 3])
def test_speculation_is_lossless(small_dir, temperature, accept):
    """Proposals that are plain decoding's own output are all accepted (None), only the first tau - 1 of
    each round (3), or none (1): the tokens kept are plain decoding's in every case, greedy or sampled."""
    prompts = prompts_of(0, 4)
    sp = SamplingParams(max_tokens=13, temperature=temperature, seed=7, ignore_eos=True)
    plain = run(engine(small_dir), {r: (p, sp) for r, p in prompts.items()})
    d = ReplayDrafter({tuple(prompts[r]): plain[r] for r in prompts}, 4, V, accept=accept)
    eng = engine(small_dir, d)
    assert run(eng, {r: (p, sp) for r, p in prompts.items()}) == plain
    st = eng.stats()
    acc, rounds = st["spec_accepted_tokens"], st["spec_rounds"]
    if accept is None:
        assert acc == st["spec_draft_tokens"] > 0
    elif accept == 1:
        assert acc == 0 and rounds >= 4 * 11  # one token a round
    else:  # two drafts a round, but in a request's last round, which max_tokens may cut short
        assert 2 * (rounds - 4) <= acc <= 2 * rounds
    assert st["kv_blocks_used"] == 0


def test_batches_mix_speculating_and_plain_requests(small_dir):
    """Sixteen requests at once, some asking for logprobs (which do not speculate), all sampled: each gets
    what it gets without speculation, and the plain ones their logprobs."""
    prompts = prompts_of(1, 16, hi=30)
    params = {r: SamplingParams(max_tokens=8, temperature=0.7, seed=i, ignore_eos=True,
                                logprobs=2 if i % 4 == 0 else None) for i, r in enumerate(prompts)}
    plain = run(engine(small_dir), {r: (prompts[r], params[r]) for r in prompts}, check=False)
    d = ReplayDrafter({tuple(prompts[r]): plain[r] for r in prompts}, 5, V, accept=3)
    eng = engine(small_dir, d)
    assert run(eng, {r: (prompts[r], params[r]) for r in prompts}) == plain
    assert eng.stats()["spec_rounds"] > 0


def test_stops_inside_a_round(small_dir):
    """A stop token among a round's kept tokens ends the request there (the rest is dropped); max_tokens
    cuts a round short."""
    prompts = prompts_of(2, 2)
    base = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = run(engine(small_dir), {r: (p, base) for r, p in prompts.items()})
    d = ReplayDrafter({tuple(prompts[r]): plain[r] for r in prompts}, 6, V)
    for r, p in prompts.items():
        stop = plain[r][5]
        want = plain[r][:plain[r].index(stop) + 1]
        sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
        assert run(engine(small_dir, d), {r: (p, sp)})[r] == want
        sp = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
        assert run(engine(small_dir, d), {r: (p, sp)})[r] == plain[r][:9]


def test_prefix_hit_with_speculation_equals_a_miss(small_dir):
    p = prompts_of(3, 1, 70, 90)["r0"]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain = run(engine(small_dir), {"a": (p, sp)})["a"]
    d = ReplayDrafter({tuple(p): plain}, 4, V)
    eng = engine(small_dir, d)
    miss = run(eng, {"a": (p, sp)})["a"]
    hit = run(eng, {"b": (p, sp)})["b"]
    assert eng.stats()["prefix_cache_hit_tokens"] >= 64
    assert hit == miss == plain


def test_abort_mid_round_leaks_nothing(small_dir):
    prompts = prompts_of(4, 3)
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain = run(engine(small_dir), {r: (p, sp) for r, p in prompts.items()})
    eng = engine(small_dir, ReplayDrafter({tuple(prompts[r]): plain[r] for r in prompts}, 4, V, accept=2))
    for r, p in prompts.items():
        eng.add_request(r, p, sp)
    for _ in range(3):
        eng.step()
    assert eng.abort_request("r1")
    eng.scheduler.check_integrity()
    while eng.has_unfinished():
        eng.step()
        eng.scheduler.check_integrity()
    assert eng.stats()["kv_blocks_used"] == 0


def test_admission_reserves_the_draft_positions(small_dir):
    """A verify step may write k positions past the committed ones: admission reserves them, so a request
    that fits plainly but not with its k extra positions is refused at once."""
    from openinfer.scheduler import RequestRejected
    d = ReplayDrafter({}, 8, V)
    eng = engine(small_dir, d, num_kv_blocks=5)  # 4 usable blocks: 64 positions
    with pytest.raises(RequestRejected):
        eng.add_request("x", list(range(1000, 1040)), SamplingParams(max_tokens=20))  # 59 + 8 positions > 64
    eng.add_request("y", list(range(1000, 1040)), SamplingParams(max_tokens=16))  # 55 + 8 fit
    assert eng.scheduler.requests["y"].blocks_needed == 4


def test_sampled_verification_keeps_the_target_distribution(tmp_path):
    """A small-vocabulary model at temperature 1, over 1,500 seeds: the third generated token of a
    speculating engine (kept by a verify step when the drafter's proposal for the second matched, by the
    next round otherwise) follows the target's marginal distribution (chi-square)."""
    cfg = dict(hf_config("tiny"), vocab_size=48, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    d = tmp_path / "small"
    write_checkpoint(d, cfg, seed=1)
    cfg = EngineConfig(str(d), device="cpu", num_kv_blocks=64, max_num_seqs=64, max_model_len=64)
    m, w = cfg.model_config, load_weights_fp32(d, cfg.model_config, progress=False)
    eng = LLMEngine(cfg, drafter=_GreedyDrafter(m, w, 3))
    prompt = [3, 17, 5, 9, 30]
    n = 1500
    reqs = {f"s{i}": (prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=i)) for i in range(n)}
    got = []
    for chunk in range(0, n, 64):
        out = run(eng, dict(list(reqs.items())[chunk:chunk + 64]), check=False)
        got += [v[2] for v in out.values()]
    st = eng.stats()
    assert st["spec_rounds"] >= n and 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"]
    # the target's marginal of the third token, in fp32 NumPy: sum of p(t1) p(t2 | t1) p(t3 | t1, t2)
    p3 = np.zeros(48)
    p1 = _softmax(dense_forward(m, w, prompt)[-1])
    for a in range(48):
        p2 = _softmax(dense_forward(m, w, prompt + [a])[-1])
        for b in range(48):
            p3 += p1[a] * p2[b] * _softmax(dense_forward(m, w, prompt + [a, b])[-1])
    counts = np.bincount(got, minlength=48)
    expected = p3 * n
    keep = expected >= 5  # the usual validity bound; the rest pooled into one cell
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    # p < 0.001 rejects: the chi-square 0.999 quantile, by the Wilson-Hilferty approximation
    z = 3.09
    bound = dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < bound, (chi2, bound, dof)


class _GreedyDrafter:
    """Proposes the target's greedy continuation (dense fp32 forwards): at temperature 1 the target's sample
    matches it now and then, so verify rounds both accept and reject."""

    in_backend = False
    lookahead = 0

    def __init__(self, model_config, weights, k):
        self.m, self.w, self.num_tokens = model_config, weights, k

    def serves(self, params):
        return True

    def propose(self, seq):
        toks, out = list(seq.token_ids), []
        for _ in range(self.num_tokens):
            out.append(int(np.argmax(dense_forward(self.m, self.w, toks)[-1])))
            toks.append(out[-1])
        return out


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_metrics_count_rounds(small_dir):
    prompts = prompts_of(5, 2)
    sp = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
    plain = run(engine(small_dir), {r: (p, sp) for r, p in prompts.items()})
    eng = engine(small_dir, ReplayDrafter({tuple(prompts[r]): plain[r] for r in prompts}, 5, V))
    run(eng, {r: (p, sp) for r, p in prompts.items()})
    st = eng.stats()
    # a prefill token, then rounds of 5 + 1 and a last one cut to 3 + 1 by max_tokens
    assert st["spec_rounds"] == 4 and st["spec_draft_tokens"] == 16 and st["spec_accepted_tokens"] == 16
    json.dumps(st)  # plain numbers, for /metrics
