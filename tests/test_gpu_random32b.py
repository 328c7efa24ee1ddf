"""The random-weight load path at 32B (its own module, so no other model is resident)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from gpu_util import requires_gpu

pytestmark = requires_gpu


def test_random_load_runs_32b(tmp_path):
    """32B does not fit the GPU machine's disk as a checkpoint: weights made on the GPU from config.json."""
    import openinfer
    from openinfer.tools.random_checkpoint import hf_config

    d = tmp_path / "qwen3-32b"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(hf_config("qwen3-32b")))
    src = Path(openinfer.__file__).parent / "data" / "qwen3-tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    with openinfer.Engine(str(d), device="cuda", load_format="random", max_model_len=4096) as eng:
        out = eng.generate(["The capital of France is"], openinfer.SamplingParams(max_tokens=16, temperature=0.0,
                                                                                  ignore_eos=True, logprobs=2))[0]
    assert len(out.token_ids) == 16 and out.finish_reason == "length"
    lps = [lp.logprob for lp in out.logprobs]
    assert len(lps) == 16 and all(np.isfinite(lps)) and max(lps) <= 0.0
    assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1] for lp in out.logprobs)
    print("32B random greedy tokens:", out.token_ids)
