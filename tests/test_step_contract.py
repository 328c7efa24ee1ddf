"""The step contract's newer fields on the NumPy backend (the oracle the CUDA engine is tested against):
several sampled rows per sequence with accepted counts (speculative verify), tap-layer hidden states,
steps of copies only, and the refusals both backends share."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import step_input

from openinfer.reference import ops
from openinfer.reference.model import accepted_counts
from openinfer.step import StepInput

PROMPT = [9707, 1879, 785, 6722, 315, 9625, 374, 11, 323, 279, 6722, 315, 9856, 374, 220, 16, 17, 18, 19, 20]


def _verify_step(be, prefix, drafts, table, temperature=0.0, seed=0):
    """One sequence: prefix already cached; verify [anchor, d1..dk] where anchor = the last prefix token."""
    anchor = prefix[-1]
    toks = [anchor] + drafts
    s = step_input([(toks, len(prefix) - 1, table)], temperature=temperature, seed=seed, verify=True)
    k = len(toks)
    s.sample_idx = np.arange(k, dtype=np.int32)
    for f in ("temperature", "top_p", "top_k", "seeds"):
        setattr(s, f, np.resize(getattr(s, f), k))
    return s


def test_verify_accepts_the_greedy_continuation_and_stops_at_a_mismatch(make_backend):
    be = make_backend(16)
    table = [1, 2, 3]
    be.step(step_input([(PROMPT[:-1], 0, table)]))  # the prefix's K/V, but its last token's
    # the greedy continuation, one token at a time
    ref = make_backend(16)
    ref.step(step_input([(PROMPT[:-1], 0, table)]))
    seq, cont = list(PROMPT), []
    for _ in range(4):
        out = ref.step(step_input([([seq[-1]], len(seq) - 1, table)]))
        seq.append(int(out.tokens[0]))
        cont.append(seq[-1])
    # verify with the true continuation: every draft accepted, plus the bonus token
    full = be.step(_verify_step(be, PROMPT, cont[:3], table))
    assert full.accepted.tolist() == [4] and full.tokens[:3].tolist() == cont[:3] and full.tokens[3] == cont[3]
    # a wrong second draft: anchor's token and d1 accepted, then the target's own token at the mismatch
    wrong = cont[:3]
    wrong[1] = (wrong[1] + 1) % 1000
    out = be.step(_verify_step(be, PROMPT, wrong, table))
    assert out.accepted.tolist() == [2] and out.tokens[:2].tolist() == cont[:2]


def test_accepted_counts_per_sequence():
    qsl = np.array([0, 3, 4, 7])  # three sequences: 3 tokens, 1 token, 3 tokens
    ids = np.array([5, 6, 7, 9, 1, 2, 3])
    sample_idx = np.array([0, 1, 2, 3, 4, 5, 6])
    tokens = np.array([6, 7, 8, 4, 2, 9, 9])  # seq 0: both drafts match; seq 1: one row; seq 2: first misses
    assert accepted_counts(ids, qsl, sample_idx, tokens).tolist() == [3, 1, 2]
    assert accepted_counts(ids, qsl, np.array([0, 1], np.int64), tokens[:2]).tolist() == [2, 0, 0]


def test_verify_refuses_rows_out_of_order(make_backend):
    be = make_backend(16)
    s = _verify_step(be, PROMPT, [1, 2], [1, 2])
    s.sample_idx = np.array([0, 2, 1], np.int32)
    with pytest.raises(ValueError, match="verify"):
        be.step(s)


def test_tap_layers_are_the_residual_stream(make_backend, tiny_cfg):
    """The last layer's tap, through the final norm and the lm_head, is the step's logits; a tap does not
    depend on how the prompt was split into chunks (up to fp32 rounding)."""
    be = make_backend(16)
    L = tiny_cfg.num_hidden_layers
    taps = np.array([0, L - 1], np.int32)
    s = step_input([(PROMPT, 0, [1, 2])], return_logits=True, tap_layers=taps,
                   tap_rows=np.arange(len(PROMPT), dtype=np.int32))
    out = be.step(s)
    assert out.hidden.shape == (len(PROMPT), 2, tiny_cfg.hidden_size)
    last = ops.rmsnorm(out.hidden[-1, 1], be.w["model.norm.weight"], tiny_cfg.rms_norm_eps) @ be.lm_head.T
    np.testing.assert_allclose(last, out.logits[0], rtol=1e-5, atol=1e-5)
    chunked = make_backend(16)
    chunked.step(step_input([(PROMPT[:7], 0, [1, 2])], tap_layers=taps, tap_rows=np.arange(7, dtype=np.int32)))
    rest = chunked.step(step_input([(PROMPT[7:], 7, [1, 2])], tap_layers=taps,
                                   tap_rows=np.arange(len(PROMPT) - 7, dtype=np.int32)))
    np.testing.assert_allclose(rest.hidden, out.hidden[7:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bad", [dict(tap_layers=np.array([99], np.int32)),
                                 dict(tap_layers=np.array([1, 1], np.int32)),
                                 dict(tap_rows=np.array([0], np.int32)),
                                 dict(tap_layers=np.array([0], np.int32), tap_rows=np.array([50], np.int32))])
def test_bad_taps_refused(make_backend, bad):
    with pytest.raises(ValueError):
        make_backend(16).step(step_input([(PROMPT[:5], 0, [1])], **bad))


def test_copies_need_a_host_tier_and_in_range_blocks(make_backend):
    s = step_input([(PROMPT[:5], 0, [1])], kv_save=np.array([[1, 0]], np.int32))
    with pytest.raises(ValueError, match="host KV tier"):
        make_backend(16).step(s)
    be = make_backend(16, num_host_blocks=4)
    for pairs in ([[0, 0]], [[16, 0]], [[1, 4]], [[1, -1]]):  # block 0 is reserved; 16 blocks; 4 slots
        with pytest.raises(ValueError, match="out of range"):
            be.step(replace(s, kv_save=np.array(pairs, np.int32)))


def test_copies_only_step_and_late_landing(make_backend):
    """A step of no tokens only issues its copies. With copy_latency, a batch lands (its bytes move) only
    after that many more launches, and copy_progress() says so."""
    be = make_backend(16, num_host_blocks=4, copy_latency=2)
    be.step(step_input([(PROMPT, 0, [3, 5])]))
    empty = StepInput(input_ids=np.zeros(0, np.int32), positions=np.zeros(0, np.int32),
                      query_start_loc=np.zeros(1, np.int32), context_lens=np.zeros(0, np.int32),
                      block_tables=np.zeros((0, 1), np.int32), slot_mapping=np.zeros(0, np.int32),
                      sample_idx=np.zeros(0, np.int32), temperature=np.zeros(0, np.float32),
                      top_p=np.zeros(0, np.float32), top_k=np.zeros(0, np.int32), seeds=np.zeros(0, np.uint64),
                      kv_save=np.array([[3, 2]], np.int32))
    out = be.step(empty)
    assert len(out.tokens) == 0 and be.copy_progress() == (1, 1)  # launch 2's copies not landed
    assert not be.host_kv[2].any()
    be.step(replace(empty, kv_save=np.zeros((0, 2), np.int32), kv_load=np.array([[2, 7]], np.int32)))
    assert be.copy_progress() == (1, 1)
    be.wait_copies()
    assert be.copy_progress() == (3, 3)
    np.testing.assert_array_equal(be.host_kv[2], be.kv_cache[3])
    np.testing.assert_array_equal(be.kv_cache[7], be.kv_cache[3])
    st = be.copy_stats()
    assert st["saved_bytes"] == st["restored_bytes"] == be.kv_cache[0].nbytes
