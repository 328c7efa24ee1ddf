"""Issue #26 item 1: the same prompt twice, cold and then as a prefix-cache hit, gives the same greedy
tokens and the same log-probs, bit for bit: the CPU reference and the CUDA engine (4B geometry, random
weights, prompts of 1 to 5000 tokens). The prompt's last token runs as a step of its own in both (the
scheduler); the hit copies the partial tail before it from the cache. The CPU reference's rows do not depend on the step at all (reference/ops.py), so there a
prompt cut into other chunks (another max_num_batched_tokens) gives the same bits too."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from gpu_util import NO_GPU

from openinfer.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)


def _outputs(eng, prompt):
    o = eng.generate(prompt, SP)[0]
    return o.token_ids, [lp.logprob for lp in o.logprobs]


def _check(make, lengths, vocab, other_chunks: bool):
    a = make(2048)
    b = make(512) if other_chunks else None  # the same weights; prompts cut into chunks of 512 tokens
    try:
        rng = np.random.default_rng(26)
        for n in lengths:
            prompt = [int(t) for t in rng.integers(1000, vocab, n)]
            hits = a.llm_engine.stats()["prefix_cache_hit_tokens"]
            cold = _outputs(a, prompt)
            hit = _outputs(a, prompt)
            assert a.llm_engine.stats()["prefix_cache_hit_tokens"] - hits >= n // 16 * 16 - 16, n  # a hit
            assert hit == cold, f"{n} tokens: a prefix hit differs from the cold run"
            if b is not None:
                assert _outputs(b, prompt) == cold, f"{n} tokens: 512-token chunks differ from 2048-token ones"
    finally:
        a.close()
        if b is not None:
            b.close()


def test_cpu_prompt_results_do_not_depend_on_chunking(tiny_dir):
    import openinfer

    def make(chunk):
        return openinfer.Engine(str(tiny_dir), device="cpu", max_model_len=2048, max_num_batched_tokens=chunk)
    _check(make, [1, 17, 333, 1100], vocab=2000, other_chunks=True)


@pytest.mark.gpu
@pytest.mark.skipif(NO_GPU is not None, reason=f"GPU test: {NO_GPU}")
def test_cuda_prompt_results_do_not_depend_on_chunking(tmp_path):
    import openinfer
    from openinfer.tools.random_checkpoint import hf_config

    d = tmp_path / "qwen3-4b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_config("qwen3-4b")))
    src = Path(openinfer.__file__).parent / "data" / "qwen3-tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)

    def make(chunk):
        return openinfer.Engine(str(d), device="cuda", load_format="random", max_model_len=8192,
                                max_num_batched_tokens=chunk, num_kv_blocks=1200)
    _check(make, [1, 17, 333, 1024, 1500, 3001, 5000], vocab=151643, other_chunks=False)
