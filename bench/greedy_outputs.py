"""Greedy token ids of a fixed prompt set on a seeded random-weight model, for comparing two trees'
outputs (run once per tree, then diff the JSON). GEMM autotuning is off so that every start computes
the same bits; the prompts mix lengths (batch of several, one long prompt, a block edge).

  python bench/greedy_outputs.py --preset qwen3-4b --out a.json
  PYTHONPATH=.alt/src:$PYTHONPATH python bench/greedy_outputs.py --out b.json   # another tree's package

Uses only the public API, so any tree's openinfer runs it.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "你好，世界。",
           "Once upon a time " * 60, "x" * 15, "List three prime numbers:", "import numpy as np\n"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import openinfer
    from openinfer.tools.random_checkpoint import hf_config

    d = Path(tempfile.mkdtemp(prefix=f"greedy-{a.preset}-"))
    (d / "config.json").write_text(json.dumps(hf_config(a.preset)))
    src = Path(openinfer.__file__).parent / "data" / "qwen3-tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    eng = openinfer.Engine(str(d), device="cuda", load_format="random", max_model_len=4096, max_num_seqs=16,
                           gemm_autotune=False)
    sp = openinfer.SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    batched = [o.token_ids for o in eng.generate(PROMPTS, sp)]
    alone = [eng.generate([p], sp)[0].token_ids for p in PROMPTS[:3]]  # batch 1: the persistent kernel
    eng.close()
    Path(a.out).write_text(json.dumps({"preset": a.preset, "openinfer": openinfer.__file__, "batched": batched,
                                       "alone": alone}))
    print(f"{a.preset}: {len(batched)} batched + {len(alone)} alone greedy continuations -> {a.out}")


if __name__ == "__main__":
    main()
