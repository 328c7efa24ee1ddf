"""Issue #26 item 2: with `deterministic`, a request's tokens and log-probs, greedy or seeded sampling,
are the same bits whatever it runs beside (alone, in batches of 8 and 64), however its prompt is cut
into steps, and as a prefix-cache hit: the CPU reference (tiny model) and the CUDA engine (4B and 8B
geometry, random weights)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpu_util import NO_GPU

from openinfer.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, top_k=50, seed=7, ignore_eos=True, logprobs=0)


def _result(o):
    return o.token_ids, [lp.logprob for lp in o.logprobs]


def _check(make, vocab, batches, lengths):
    rng = np.random.default_rng(262)
    prompts = [[int(t) for t in rng.integers(1000, vocab, n)] for n in lengths]
    others = [[int(t) for t in rng.integers(1000, vocab, int(rng.integers(5, 300)))] for _ in range(max(batches))]
    a, b = make(2048), make(64)  # the same weights; prompts in chunks of 2048 and of 64 tokens
    try:
        for sp in (GREEDY, SAMPLED):
            for p in prompts:
                alone = _result(a.generate(p, sp)[0])
                assert _result(a.generate(p, sp)[0]) == alone, "a prefix hit differs"
                assert _result(b.generate(p, sp)[0]) == alone, "64-token chunks differ"
                for n in batches:  # beside n - 1 others, greedy and sampled, in the middle of the batch
                    batch = others[:n // 2] + [p] + others[n // 2:n - 1]
                    params = [(GREEDY, SAMPLED)[i % 2] for i in range(n)]
                    params[n // 2] = sp
                    outs = a.generate(batch, params)
                    assert _result(outs[n // 2]) == alone, f"{len(p)} tokens in a batch of {n} differ"
    finally:
        a.close()
        b.close()


def test_cpu_deterministic_whatever_the_batch(tiny_dir):
    import openinfer

    def make(chunk):
        return openinfer.Engine(str(tiny_dir), device="cpu", max_model_len=2048, max_num_batched_tokens=chunk,
                                max_num_seqs=16, deterministic=True, num_kv_blocks=400)
    _check(make, 2000, batches=[8], lengths=[1, 33, 300])


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU is not None, reason=f"GPU test: {NO_GPU}")
@pytest.mark.parametrize("preset", ["qwen3-4b", "qwen3-8b"])
def test_cuda_deterministic_whatever_the_batch(tmp_path, preset):
    import openinfer
    from openinfer.tools.random_checkpoint import hf_config

    d = tmp_path / preset
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_config(preset)))
    src = Path(openinfer.__file__).parent / "data" / "qwen3-tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)

    def make(chunk):
        return openinfer.Engine(str(d), device="cuda", load_format="random", max_model_len=8192,
                                max_num_batched_tokens=chunk, max_num_seqs=64, num_kv_blocks=3000,
                                deterministic=True)
    _check(make, 151643, batches=[8, 64], lengths=[1, 17, 1500, 5000])
