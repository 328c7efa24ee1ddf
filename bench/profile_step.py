"""One eager decode step of a random-weight model under `ncu --profile-from-start off`: per-kernel times.

  ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
      python bench/profile_step.py --preset qwen3-4b --batch 1 --ctx 1024
"""
from __future__ import annotations

import argparse

import numpy as np

from bench_engine import Runner, model_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    a = ap.parse_args()
    import openinfer
    from openinfer import _engine

    eng = openinfer.Engine(str(model_dir(a.preset)), device="cuda", load_format="random", max_model_len=a.ctx + 64,
                           max_num_seqs=max(8, a.batch), cuda_graph=False)
    r = Runner(eng.llm_engine.backend, 151936)
    seqs = [r.alloc(a.ctx + 8) for _ in range(a.batch)]
    for s in seqs:
        r.step([(s, 0, a.ctx - 1)])
    for i in range(3):
        r.step([(s, a.ctx - 1 + i, 1) for s in seqs])
    _engine.profiler_start()
    r.step([(s, a.ctx + 2, 1) for s in seqs])
    _engine.profiler_stop()


if __name__ == "__main__":
    main()
