"""CPU tests of bench/bench_engine.py's step driver on the reference backend: the overlapped decode loop
keeps the backend's launch/collect contract (the reference backend raises where the CUDA engine would)
and feeds each step the previous step's tokens, as the server does."""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from bench_engine import Runner  # noqa: E402
from openinfer.reference import ReferenceBackend  # noqa: E402


def _prefilled(cfg, weights):
    r = Runner(ReferenceBackend(cfg, weights, num_blocks=32), cfg.vocab_size, seed=3)
    seqs = [r.alloc(40) for _ in range(3)]
    r.step([(s, 0, 7) for s in seqs])  # prompts of 7 tokens
    return r, seqs


def test_overlapped_decode_feeds_the_previous_tokens(tiny_cfg, tiny_weights):
    steps = 6
    r, seqs = _prefilled(tiny_cfg, tiny_weights)
    gaps, got = r.overlapped(lambda i: [(s, 7 + i, 1) for s in seqs], steps)
    assert len(gaps) == steps - 2 and all(g > 0 for g in gaps)
    assert len(got) == steps and not r.b._pending  # every launched step was collected

    # The same decode run synchronously, each step given the previous step's tokens: the same tokens.
    r2, seqs2 = _prefilled(tiny_cfg, tiny_weights)
    want, ids = [], None
    for i in range(steps):
        a = r2.args([(s, 7 + i, 1) for s in seqs2])
        if ids is not None:
            a.input_ids = ids
        ids = r2.b.step(a).tokens.astype(np.int32)
        want.append(ids)
    assert all(np.array_equal(x, y) for x, y in zip(got, want))
    assert len({tuple(t) for t in want}) > 1  # the tokens move from step to step
