"""One decode step of a random-weight model between profiler start and stop: per-kernel times of an
eager step under ncu, or (--graph --trace) the replayed CUDA graph's kernels on a timeline (CUPTI,
through torch's profiler: the GPU machine has no nsys).

  ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
      python bench/profile_step.py --preset qwen3-4b --batch 1 --ctx 1024
  python bench/profile_step.py --graph --steps 4 --trace step.json   # CUPTI through torch.profiler
"""
from __future__ import annotations

import argparse

import numpy as np

from bench_engine import Runner, model_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024, help="cached tokens before the profiled chunk (0: a cold "
                    "prefill of --chunk tokens, e.g. --ctx 0 --chunk 1024)")
    ap.add_argument("--chunk", type=int, default=1, help="tokens per sequence in the profiled step (1: decode; "
                    "more: a prompt's last chunk after ctx cached tokens, e.g. a prefix-cache hit)")
    ap.add_argument("--graph", action="store_true", help="replay the decode CUDA graph (default: eager)")
    ap.add_argument("--steps", type=int, default=1, help="steps between profiler start and stop")
    ap.add_argument("--trace", default=None, help="write the steps' kernels as a Chrome trace (needs torch: "
                    "its profiler reads CUPTI, graph nodes included; a benchmark-only dependency)")
    ap.add_argument("--options", default="", help="EngineConfig settings, as 'name=value,...' (bench_engine's syntax)")
    a = ap.parse_args()
    import openinfer
    from bench_engine import option_settings
    from openinfer import _engine

    kw = dict(device="cuda", load_format="random", max_model_len=a.ctx + 64 + a.chunk * (a.steps + 3),
              max_num_seqs=max(8, a.batch), cuda_graph=a.graph)
    eng = openinfer.Engine(str(model_dir(a.preset)), **{**kw, **option_settings(a.options)[0][1]})
    r = Runner(eng.llm_engine.backend, 151936)
    seqs = [r.alloc(a.ctx + 8 + a.chunk * (a.steps + 3)) for _ in range(a.batch)]
    for s in seqs:  # the prompt in chunks of at most one step's token budget
        for p0 in range(0, a.ctx - 1, 8192):
            r.step([(s, p0, min(8192, a.ctx - 1 - p0))])
    n = a.chunk
    if a.ctx == 0:  # a cold prefill: every step is the first chunk of new sequences (warm-ups plan the shapes)
        for _ in range(3):
            r.step([(r.alloc(n + 8), 0, n) for _ in range(a.batch)])
        if a.trace is None:
            fresh = [[r.alloc(n + 8) for _ in range(a.batch)] for _ in range(a.steps)]
            _engine.profiler_start()
            for group in fresh:
                r.step([(s, 0, n) for s in group])
            _engine.profiler_stop()
            return
    for i in range(3):
        r.step([(s, a.ctx - 1 + i * n, n) for s in seqs])
    p0 = a.ctx - 1 + 3 * n
    if a.trace:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(a.steps):
                r.step([(s, p0 + i * n, n) for s in seqs])
        prof.export_chrome_trace(a.trace)
        return
    _engine.profiler_start()
    for i in range(a.steps):
        r.step([(s, p0 + i * n, n) for s in seqs])
    _engine.profiler_stop()


if __name__ == "__main__":
    main()
