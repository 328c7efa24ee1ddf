"""The paged reference step against the independent dense forward, and the paging contract."""
import numpy as np
import pytest
from conftest import step_input

from openinfer.reference import ops

RTOL = ATOL = 1e-4
PROMPT = [9707, 1879, 785, 6722, 315, 9625, 374, 11, 323, 279, 6722, 315, 9856, 374, 220, 16, 17, 18,
          19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41]


def logits_of(be, seqs, **kw):
    return be.step(step_input(seqs, return_logits=True, **kw))


def test_prefill_and_decode_match_dense(make_backend):
    be = make_backend(16)
    table = [3, 9, 5, 1]
    ids = PROMPT[:20]
    out = logits_of(be, [(ids, 0, table)], sample=[True])
    np.testing.assert_allclose(out.logits[0], be.dense_forward(ids)[-1], rtol=RTOL, atol=ATOL)
    for _ in range(5):  # greedy decode: one token per step against the growing dense sequence
        ids = ids + [int(out.tokens[0])]
        out = logits_of(be, [([ids[-1]], len(ids) - 1, table)])
        dense = be.dense_forward(ids)[-1]
        np.testing.assert_allclose(out.logits[0], dense, rtol=RTOL, atol=ATOL)
        assert out.tokens[0] == np.argmax(dense)


def test_prefill_all_rows_match_dense(make_backend):
    be = make_backend(16)
    ids = PROMPT[:33]
    args = step_input([(ids, 0, [1, 2, 3])], return_logits=True)
    args.sample_idx = np.arange(len(ids), dtype=np.int32)
    S = len(ids)
    for k in ("temperature", "top_p", "top_k", "seeds"):
        setattr(args, k, np.resize(getattr(args, k), S))
    out = be.step(args)
    np.testing.assert_allclose(out.logits, be.dense_forward(ids), rtol=RTOL, atol=ATOL)


def test_paged_equals_contiguous(make_backend):
    ids = PROMPT[:40]
    a = logits_of(make_backend(16), [(ids, 0, [1, 2, 3])])
    b = logits_of(make_backend(16), [(ids, 0, [14, 6, 11])])  # shuffled, non-consecutive
    np.testing.assert_array_equal(a.logits, b.logits)


@pytest.mark.parametrize("chunks", [[1] * 6 + [7, 16, 17], [7, 16, 17, 1], [16, 16, 9], [17, 24]])
def test_chunked_prefill_equals_one_shot(make_backend, chunks):
    ids = PROMPT[:sum(chunks)]
    table = [7, 2, 12]
    one = logits_of(make_backend(16), [(ids, 0, table)])
    be, start = make_backend(16), 0
    for n in chunks:
        out = logits_of(be, [(ids[start:start + n], start, table)])
        start += n
    np.testing.assert_allclose(out.logits, one.logits, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(out.logits[0], be.dense_forward(ids)[-1], rtol=RTOL, atol=ATOL)


def test_batch_equals_each_alone(make_backend):
    seqs = [(PROMPT[:5], 0, [4]), (PROMPT[3:23], 0, [8, 2]), (PROMPT[:33], 0, [1, 11, 6])]
    batched = logits_of(make_backend(16), seqs)
    for i, s in enumerate(seqs):
        alone = logits_of(make_backend(16), [s])
        np.testing.assert_allclose(batched.logits[i], alone.logits[0], rtol=RTOL, atol=ATOL)
    # and a mixed step: a decode row beside a prefill chunk
    be = make_backend(16)
    first = logits_of(be, [(PROMPT[:9], 0, [5])])
    mixed = logits_of(be, [([int(first.tokens[0])], 9, [5]), (PROMPT[:12], 0, [9])])
    np.testing.assert_allclose(mixed.logits[0], be.dense_forward(PROMPT[:9] + [int(first.tokens[0])])[-1],
                               rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(mixed.logits[1], be.dense_forward(PROMPT[:12])[-1], rtol=RTOL, atol=ATOL)


def test_padding_rows_leave_cache_untouched(make_backend):
    be = make_backend(8)
    logits_of(be, [(PROMPT[:10], 0, [2])])
    before = be.kv_cache.copy()
    args = step_input([([PROMPT[10]], 10, [2]), ([0, 0, 0], 0, [0])])  # a real decode row + 3 padding rows
    args.slot_mapping[1:] = -1
    be.step(args)
    changed = np.argwhere((be.kv_cache != before).any(axis=(1, 2, 3, 5)))  # (block, offset) pairs
    assert changed.tolist() == [[2, 10]]  # every other slot, block 0 included, is bit-identical
    ref = make_backend(8)
    logits_of(ref, [(PROMPT[:10], 0, [2])])
    logits_of(ref, [([PROMPT[10]], 10, [2])])
    # the real row's K/V equal a step without padding (up to GEMM-shape rounding)
    np.testing.assert_allclose(be.kv_cache, ref.kv_cache, rtol=RTOL, atol=ATOL)
    args = step_input([([5, 6], 0, [0])])
    args.slot_mapping[:] = -1  # a step of padding rows only
    snapshot = be.kv_cache.copy()
    be.step(args)
    np.testing.assert_array_equal(be.kv_cache, snapshot)


def test_step_logprobs(make_backend):
    be = make_backend(8)
    out = be.step(step_input([(PROMPT[:7], 0, [1])], temperature=0.7, seed=3, num_logprobs=5, return_logits=True))
    lp = ops.log_softmax(out.logits[0].astype(np.float64))
    order = np.argsort(-lp, kind="stable")[:5]
    assert out.top_ids[0].tolist() == order.tolist()
    np.testing.assert_allclose(out.top_logprobs[0], lp[order], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.logprobs[0], lp[out.tokens[0]], rtol=1e-5, atol=1e-5)
    assert out.top_ids.dtype == np.int32 and out.tokens.dtype == np.int32 and out.logprobs.dtype == np.float32


def test_sampled_tokens_independent_of_batch(make_backend):
    a = make_backend(16).step(step_input([(PROMPT[:9], 0, [1])], temperature=1.0, seed=42))
    b = make_backend(16).step(step_input([(PROMPT[2:30], 0, [3, 4]), (PROMPT[:9], 0, [1])],
                                         temperature=1.0, seed=42))
    assert a.tokens[0] == b.tokens[1]


def test_tiny_step_is_fast(make_backend):
    import time
    be = make_backend(16)
    t0 = time.perf_counter()
    logits_of(be, [(PROMPT[:40], 0, [1, 2, 3])])
    assert time.perf_counter() - t0 < 1.0


def test_rows_are_bit_identical_whatever_the_step(make_backend):
    """The reference's rows do not depend on the rest of the step (reference/ops.py: padded BLAS rows,
    attention summed per fixed key segment, the lm_head included): a sequence alone, batched with others,
    or its prompt cut into other chunks gives the same logits bit for bit."""
    mk = make_backend  # a fresh backend (empty cache) per run
    seqs = [(PROMPT[:5], 0, [4]), (PROMPT[3:23], 0, [8, 2]), (PROMPT[:33], 0, [1, 11, 6])]
    batched = logits_of(mk(16), seqs)
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(batched.logits[i], logits_of(mk(16), [s]).logits[0])
    ids, table = PROMPT[:33], [7, 2, 12]
    one = logits_of(mk(16), [(ids, 0, table)])
    be, start = mk(16), 0
    for n in (7, 16, 1, 9):
        out = logits_of(be, [(ids[start:start + n], start, table)])
        start += n
    np.testing.assert_array_equal(out.logits, one.logits)
