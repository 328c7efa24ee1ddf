"""runner.pack: the list path (a few tokens) and the NumPy path (many) pack the same StepInput."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from openinfer import runner
from openinfer.sampling_params import SamplingParams
from openinfer.scheduler import Restore, ScheduledBatch, ScheduledSeq
from openinfer.step import StepInput


def _batch(rng, block_size: int) -> ScheduledBatch:
    """Random items as the scheduler makes them: prompt chunks, decode rows (fed or not), verify rows
    with drafts; tables that cover each item's tokens and maybe more; copies."""
    batch = ScheduledBatch()
    n_items = int(rng.integers(0, 7))
    for b in range(n_items):
        kind = rng.choice(["chunk", "decode", "fed", "verify"])
        n_prompt = int(rng.integers(1, 90))
        token_ids = rng.integers(0, 1000, n_prompt + int(rng.integers(0, 20))).tolist()
        drafts = rng.integers(0, 1000, int(rng.integers(1, 5))).tolist() if kind == "verify" else []
        if kind == "chunk":
            start = int(rng.integers(0, n_prompt))
            n = int(rng.integers(1, n_prompt - start + 1))
            sample = start + n == len(token_ids)
        else:
            start, n, sample = len(token_ids) - 1, 1 + len(drafts), True
        need = -(-(start + n) // block_size) + int(rng.integers(0, 3))
        params = SamplingParams(temperature=float(rng.choice([0.0, 0.7])), top_p=float(rng.choice([1.0, 0.9])),
                                top_k=int(rng.choice([0, 20])), logprobs=[None, 0, 3][int(rng.integers(3))])
        seq = SimpleNamespace(token_ids=token_ids, block_table=rng.integers(1, 500, need).tolist(), params=params,
                              seed=int(rng.integers(0, 2**63)))
        batch.items.append(ScheduledSeq(seq, start, n, sample, feed_row=b if kind == "fed" else -1, drafts=drafts,
                                        draft=bool(rng.random() < 0.2)))
    if rng.random() < 0.3:
        batch.kv_save = [(int(rng.integers(1, 500)), int(rng.integers(0, 50))) for _ in range(int(rng.integers(1, 4)))]
    if rng.random() < 0.3:
        batch.restores = [Restore(None, [(1, 2), (3, 4)], 0)]
    return batch


def _same(a: StepInput, b: StepInput) -> None:
    for f in dataclasses.fields(StepInput):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, f.name
            assert x.flags.c_contiguous and y.flags.c_contiguous, f.name
            assert np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("block_size", [16, 5])
def test_list_and_numpy_paths_pack_the_same(monkeypatch, block_size):
    rng = np.random.default_rng(block_size)
    for _ in range(300):
        batch = _batch(rng, block_size)
        monkeypatch.setattr(runner, "SMALL", 1 << 30)
        small = runner.pack(batch, block_size)
        monkeypatch.setattr(runner, "SMALL", 0)
        large = runner.pack(batch, block_size)
        _same(small, large)
        # what the step contract asks, checked on the packed arrays
        qsl = small.query_start_loc
        assert qsl[0] == 0 and qsl[-1] == len(small.input_ids) == len(small.positions) == len(small.slot_mapping)
        for b, it in enumerate(batch.items):
            pos = small.positions[qsl[b]:qsl[b + 1]]
            assert pos.tolist() == list(range(it.start, it.start + it.num_tokens))
            table = it.seq.block_table
            assert small.slot_mapping[qsl[b]:qsl[b + 1]].tolist() == [table[p // block_size] * block_size
                                                                       + p % block_size for p in pos]
