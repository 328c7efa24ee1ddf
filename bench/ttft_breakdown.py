"""Where a request's time to first token goes, inside the engine (no HTTP): add_request, then each engine
step until the first token (wall and GPU time), for a cold prompt (no host tier), a GPU prefix hit and a
host restore (pure host-restore mode), at a few prompt lengths. Compare with bench/host_tier_bench.py ttft (through
the server) to read the HTTP path's share.

  python bench/ttft_breakdown.py --preset qwen3-4b --lengths 256,4096,16384 --out breakdown.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from bench_engine import model_dir


def first_token(eng, rid: str, ids: list[int], sp) -> dict:
    t0 = time.perf_counter()
    eng.add_request(rid, ids, sp)
    t_add = time.perf_counter()
    steps = []
    got = None
    while got is None:
        s0 = time.perf_counter()
        ups = eng.step()
        steps.append(((time.perf_counter() - s0) * 1e3, eng.stats()["last_step_gpu_ms"]))
        got = next((u for u in ups if u.request_id == rid and u.new_token_ids), None)
    t_first = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return dict(add_ms=(t_add - t0) * 1e3, first_token_ms=(t_first - t0) * 1e3, steps=steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--lengths", default="256,4096,16384")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model-path", default=None, help="a checkpoint (default: random weights of --preset)")
    ap.add_argument("--modes", default="cold,gpu_hit,host_restore")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import openinfer
    from openinfer import EngineConfig, LLMEngine

    d = a.model_path or model_dir(a.preset)
    sp = openinfer.SamplingParams(max_tokens=1, temperature=0.0)
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in a.lengths.split(",")]
    prompts = {n: rng.integers(1000, 150000, n).tolist() for n in lengths}
    out = {}
    tier = dict(kv_offload=True, kv_offload_host_gib=8)
    # cold: a new prompt each time (after one of the same length, which makes its GEMM plans), no host tier
    for mode, kw in (("cold", {}), ("gpu_hit", tier), ("host_restore", dict(enable_prefix_caching=False, **tier))):
        if mode not in a.modes.split(","):
            continue
        eng = LLMEngine(EngineConfig(str(d), device=a.device, load_format="safetensors" if a.model_path else "random",
                                     max_model_len=17000, gpu_memory_utilization=0.6, **kw))
        for n in lengths:
            first_token(eng, f"{mode}-{n}-first", prompts[n], sp)
            eng.backend.wait_copies()
            fresh = (lambda: rng.integers(1000, 150000, n).tolist()) if mode == "cold" else (lambda: prompts[n])
            runs = [first_token(eng, f"{mode}-{n}-{i}", fresh(), sp) for i in range(a.reps)]
            med = statistics.median(r["first_token_ms"] for r in runs)
            r = min(runs, key=lambda r: abs(r["first_token_ms"] - med))
            out[f"{mode}_{n}"] = r
            print(f"{mode:12} {n:6d}: first token {r['first_token_ms']:7.2f} ms (add_request {r['add_ms']:.2f}); "
                  f"steps (wall, GPU ms): {[(round(w, 2), round(g, 2)) for w, g in r['steps']]}", flush=True)
        eng.close()
    if a.out:
        json.dump(out, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
