"""Sampling per docs/architecture.md: greedy, Gumbel draw from the counter hash, top-k/top-p."""
import numpy as np
import pytest

from openinfer.reference import ops


def draw(logits, temperature=1.0, top_p=1.0, top_k=0, seed=0, pos=0):
    S = len(logits)
    return ops.sample(np.asarray(logits, np.float32), np.full(S, temperature, np.float32),
                      np.full(S, top_p, np.float32), np.full(S, top_k, np.int32),
                      np.full(S, seed, np.uint64), np.full(S, pos, np.int32))


def test_mix64_is_splitmix64():
    # splitmix64 with state 0: first output 0xE220A8397B1DCDAF (published test vector)
    assert int(ops.mix64(np.array([0x9E3779B97F4A7C15], np.uint64))[0]) == 0xE220A8397B1DCDAF


def test_gumbel_matches_formula():
    seed, pos = 12345, 7
    g = ops.gumbel_noise(seed, pos, 4)
    M = (1 << 64) - 1
    for i in range(4):
        x = (seed * 0x9E3779B97F4A7C15 + (pos + 1) * 0xD1B54A32D192ED03 + i) & M
        x ^= x >> 30; x = (x * 0xBF58476D1CE4E5B9) & M
        x ^= x >> 27; x = (x * 0x94D049BB133111EB) & M
        x ^= x >> 31
        u = (np.float32(x >> 41) + np.float32(0.5)) * np.float32(2.0 ** -23)
        assert g[i] == -np.log(-np.log(np.float32(u)))


def test_gumbel_never_infinite_at_the_top_of_the_range():
    # the largest 23-bit draw plus 0.5 is exact in float32, so u < 1 and the noise stays finite
    top = (np.float32((1 << 23) - 1) + np.float32(0.5)) * np.float32(2.0 ** -23)
    assert top < 1 and np.isfinite(-np.log(-np.log(top)))
    assert np.isfinite(ops.gumbel_noise(3, 1, 151936)).all()


def test_greedy_takes_lowest_id_on_ties():
    rows = np.array([[0.1, 3.0, 3.0, -1.0], [5.0, 1.0, 5.0, 0.0]], np.float32)
    assert draw(rows, temperature=0.0).tolist() == [1, 0]


def test_seeded_reproducible_and_seed_sensitive():
    logits = np.random.default_rng(1).standard_normal((1, 1000)).astype(np.float32)
    a = [int(draw(logits, seed=5, pos=p)[0]) for p in range(50)]
    assert a == [int(draw(logits, seed=5, pos=p)[0]) for p in range(50)]
    b = [int(draw(logits, seed=6, pos=p)[0]) for p in range(50)]
    assert a != b and len(set(a)) > 10


def test_topk1_and_tiny_top_p_are_greedy():
    logits = np.random.default_rng(2).standard_normal((8, 3000)).astype(np.float32) * 3
    greedy = draw(logits, temperature=0.0)
    for p in range(5):
        assert np.array_equal(draw(logits, temperature=1.5, top_k=1, pos=p, seed=p), greedy)
        assert np.array_equal(draw(logits, temperature=1.5, top_p=1e-6, pos=p, seed=p), greedy)


def test_independent_of_batch_composition():
    rng = np.random.default_rng(3)
    row = rng.standard_normal(500).astype(np.float32)
    others = rng.standard_normal((3, 500)).astype(np.float32)
    alone = draw(row[None], seed=9, pos=4)[0]
    for k in range(4):
        batch = np.insert(others, k, row, axis=0)
        S = len(batch)
        seeds = np.array([1, 2, 3, 4, 5], np.uint64)[:S]
        seeds[k] = 9
        pos = np.array([10, 20, 30, 40, 50], np.int32)[:S]
        pos[k] = 4
        out = ops.sample(batch, np.ones(S, np.float32), np.ones(S, np.float32), np.zeros(S, np.int32), seeds, pos)
        assert out[k] == alone


def chi2_ok(counts, probs, n):
    expected = probs * n
    m = expected > 0
    assert counts[~m].sum() == 0, "drew a token that should be excluded"
    chi2 = ((counts[m] - expected[m]) ** 2 / expected[m]).sum()
    dof = m.sum() - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof) + 10, (chi2, dof)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 3, 1.0), (1.0, 0, 0.8)])
def test_empirical_distribution_matches_softmax(temperature, top_k, top_p):
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
    n = 20000
    S = n
    rows = np.broadcast_to(logits, (S, len(logits)))
    toks = ops.sample(rows, np.full(S, temperature, np.float32), np.full(S, top_p, np.float32),
                      np.full(S, top_k, np.int32), np.full(S, 77, np.uint64), np.arange(S, dtype=np.int32))
    counts = np.bincount(toks, minlength=len(logits))
    l = logits.astype(np.float64) / temperature
    keep = ops.keep_mask((logits / np.float32(temperature)).astype(np.float32), top_p, top_k)
    p = np.where(keep, np.exp(l - l.max()), 0)
    chi2_ok(counts, p / p.sum(), n)


def test_top_p_threshold_smallest_set_with_ties():
    l = np.log(np.array([0.4, 0.2, 0.2, 0.1, 0.1], np.float32))
    assert ops.keep_mask(l, 0.5, 0).tolist() == [True, True, True, False, False]  # tie at 0.2 kept
    assert ops.keep_mask(l, 0.4, 0).tolist() == [True, False, False, False, False]
    assert ops.keep_mask(l, 0.95, 0).tolist() == [True] * 5
    assert ops.keep_mask(l, 1.0, 2).tolist() == [True, True, True, False, False]  # top-k ties kept


def test_logprobs_top_n():
    lp = ops.log_softmax(np.array([[1.0, 3.0, 3.0, 0.0]], np.float32))
    ids, vals = ops.top_logprobs(lp, 3)
    assert ids.tolist() == [[1, 2, 0]]
    np.testing.assert_allclose(np.exp(lp).sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(vals[0], lp[0, [1, 2, 0]])


def test_params_normalised_so_no_request_can_fail_a_batch():
    from openinfer import SamplingParams
    assert SamplingParams(top_k=2**63).top_k == 0  # beyond any vocabulary: off (and fits int32)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=1e-30).temperature == 0.0  # 1/t would overflow float32: greedy
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=1e308)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("inf"))


def test_tiny_top_p_stays_positive_in_float32():
    """A top_p that float32 rounds to 0 would be refused on the device, failing the whole step for every
    request in it (found by a fuzzing pass): below 1e-6 (under 1/vocabulary: the top token alone) it is
    raised to 1e-6."""
    from openinfer import SamplingParams
    for top_p in (1e-50, 5e-324, 1e-7):
        p = SamplingParams(top_p=top_p)
        assert p.top_p == 1e-6 and np.float32(p.top_p) > 0
    assert SamplingParams(top_p=0.5).top_p == 0.5


def test_stop_token_ids_capped_and_a_set():
    from openinfer import SamplingParams
    p = SamplingParams(stop_token_ids=[5, 7, 5])
    assert p.stop_token_ids == [5, 7, 5] and p.stop_token_set == {5, 7}
    with pytest.raises(ValueError, match="at most 1024"):
        SamplingParams(stop_token_ids=list(range(1025)))
