"""Engine-level speed: decode step time by batch size at a given context, and prefill time.

Drives the CUDA backend's step() directly (no scheduler, no HTTP), so it measures the engine: wall time
per step (Python + metadata copy + GPU + result copy) and GPU time per step (CUDA events).

  python bench/bench_engine.py --preset qwen3-4b --ctx 1024 --batches 1,8,32,64 --out bench/results/engine.json

Weights come from the random load path (same speed as a checkpoint; 32B does not fit the disk anyway).
Floors: bytes read per decode step over the measured 4.21 TB/s copy rate of the H200 (QWEN3.md).
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FLOOR_MS = {"qwen3-4b": 1.91, "qwen3-8b": 3.59, "qwen3-32b": 15.2}


def knob_settings(knobs: str) -> list[tuple[str, list[tuple[str, int]]]]:
    """'a=1,b=2;a=0,b=2' -> [(text, [(name, value), ...]), ...]. Every setting must name the same knobs: a
    knob keeps its value until it is set again, so one left out would carry the last setting's value."""
    out = []
    for setting in knobs.split(";"):
        pairs = [(kv.split("=")[0], int(kv.split("=")[1])) for kv in setting.split(",") if kv]
        out.append((setting, pairs))
    names = [sorted(n for n, _ in pairs) for _, pairs in out]
    if any(n != names[0] for n in names):
        raise SystemExit(f"--knobs: every setting must name the same knobs: {names}")
    return out


def apply_knobs(ops, pairs: list[tuple[str, int]]) -> None:
    for name, value in pairs:
        getattr(ops, name)(value)


def model_dir(preset: str) -> Path:
    """A config-only model directory (enough for load_format='random')."""
    import openinfer
    from openinfer.tools.random_checkpoint import hf_config

    d = Path(tempfile.mkdtemp(prefix=f"bench-{preset}-"))
    (d / "config.json").write_text(json.dumps(hf_config(preset)))
    src = Path(openinfer.__file__).parent / "data" / "qwen3-tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    return d


# Sampling per row: greedy, or the Qwen3 releases' generation_config.json defaults (what the server
# applies when a request leaves them out), or a client that sends temperature and top_p only (on a
# random-weight model the nucleus is wide: the sampler's slowest path): temperature, top_p, top_k.
SAMPLING = {"greedy": (0.0, 1.0, 0), "qwen": (0.6, 0.95, 20), "top_p": (0.6, 0.95, 0)}


class Runner:
    def __init__(self, backend, vocab: int, seed: int = 0, sampling: str = "greedy"):
        self.b = backend
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab
        self.next_block = 1
        self.sampling = SAMPLING[sampling]

    def alloc(self, n_tokens: int) -> list[int]:
        n = -(-n_tokens // 16)
        if self.next_block + n > self.b.num_kv_blocks:
            raise RuntimeError("KV pool too small for this benchmark")
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def step(self, seqs, sample_last=True):
        """seqs: list of (block ids, first new position, number of new tokens)."""
        ids, pos, qsl, ctx, slots, sample = [], [], [0], [], [], []
        M = max(len(b) for b, _, _ in seqs)
        bt = np.zeros((len(seqs), M), np.int32)
        for i, (blocks, p0, n) in enumerate(seqs):
            ids.append(self.rng.integers(0, 151643, n, dtype=np.int32))
            pos.append(np.arange(p0, p0 + n, dtype=np.int32))
            b = np.asarray(blocks, np.int32)
            slots.append(b[pos[-1] // 16] * 16 + pos[-1] % 16)
            bt[i, :len(blocks)] = blocks
            qsl.append(qsl[-1] + n)
            ctx.append(p0 + n)
            sample.append(qsl[-1] - 1)
        S = len(sample)
        temp, top_p, top_k = self.sampling
        t0 = time.perf_counter()
        self.b.step(np.concatenate(ids), np.concatenate(pos), np.array(qsl, np.int32), np.array(ctx, np.int32), bt,
                    np.concatenate(slots).astype(np.int32), np.array(sample, np.int32),
                    np.full(S, temp, np.float32), np.full(S, top_p, np.float32), np.full(S, top_k, np.int32),
                    np.arange(S, dtype=np.uint64))
        return (time.perf_counter() - t0) * 1e3, self.b.last_gpu_ms


def bench_preset(preset: str, ctx: int, batches: list[int], steps: int, prefill_len: int, pdl: str,
                 sampling: str = "greedy") -> list[dict]:
    import openinfer

    t0 = time.perf_counter()
    eng = openinfer.Engine(str(model_dir(preset)), device="cuda", load_format="random", max_num_seqs=max(batches),
                           max_model_len=max(ctx + steps + 16, prefill_len + 16), pdl=pdl != "0")
    init_s = time.perf_counter() - t0
    r = Runner(eng.llm_engine.backend, eng.llm_engine.model_config.vocab_size, sampling=sampling)
    rows = []
    # prefill: one prompt of prefill_len tokens, one step
    blocks = r.alloc(prefill_len)
    for _ in range(2):
        r.step([(blocks, 0, prefill_len)])
    pre = [r.step([(blocks, 0, prefill_len)]) for _ in range(5)]
    rows.append({"preset": preset, "pdl": pdl, "what": "prefill", "tokens": prefill_len,
                 "wall_ms_median": statistics.median(w for w, _ in pre),
                 "gpu_ms_median": statistics.median(g for _, g in pre), "engine_init_s": init_s})
    print(json.dumps(rows[-1]), flush=True)
    for B in batches:
        seqs = [r.alloc(ctx + steps + 2) for _ in range(B)]
        done = 0
        chunk = max(1, 8192 // ctx)
        while done < B:  # fill each sequence's cache with a real prefill
            r.step([(s, 0, ctx - 1) for s in seqs[done:done + chunk]])
            done += chunk
        walls, gpus = [], []
        for i in range(steps):
            w, g = r.step([(s, ctx - 1 + i, 1) for s in seqs])
            if i >= 3:  # warm-up
                walls.append(w)
                gpus.append(g)
        row = {"preset": preset, "pdl": pdl, "what": "decode", "sampling": sampling, "batch": B, "ctx": ctx,
               "steps": len(walls),
               "wall_ms_median": statistics.median(walls), "gpu_ms_median": statistics.median(gpus),
               "wall_ms_p90": float(np.percentile(walls, 90))}
        row["cpu_overhead_ms"] = row["wall_ms_median"] - row["gpu_ms_median"]
        if B == 1 and preset in FLOOR_MS:
            row["floor_ms"] = FLOOR_MS[preset]
            row["ratio_to_floor"] = row["wall_ms_median"] / FLOOR_MS[preset]
        rows.append(row)
        print(json.dumps(row), flush=True)
        r.next_block = blocks[-1] + 1  # reuse the pool for the next batch size
    eng.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-4b", help="comma-separated presets")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--knobs", default="", help="experiment switches set before the engine is made, as "
                    "'name=value,...' calls of _engine.ops; settings separated by ';' run in turn in this process "
                    "(e.g. 'attention_cluster_cap=0;attention_cluster_cap=4'); every setting names the same knobs, "
                    "since a knob keeps its value until it is set again")
    ap.add_argument("--sampling", default="greedy", choices=sorted(SAMPLING),
                    help="greedy, or qwen: temperature 0.6, top_p 0.95, top_k 20 (the releases' defaults)")
    ap.add_argument("--pdl", default="1", help="programmatic dependent launch: 1, 0, or 1,0 for an A/B")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    settings = knob_settings(a.knobs)
    rows = []
    for preset in a.preset.split(","):
        from openinfer import _engine
        for setting, pairs in settings:
            apply_knobs(_engine.ops, pairs)
            for pdl in a.pdl.split(","):
                got = bench_preset(preset, a.ctx, batches, a.steps, a.prefill_len, pdl, a.sampling)
                for r in got:
                    r["knobs"] = setting
                rows += got
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip()
    except OSError:
        gpu = ""
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit,
              "machine": {"gpu": gpu, "host": platform.node()}, "rows": rows}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'preset':10} {'pdl':3} {'knobs':24} {'what':8} {'batch':>5} {'wall ms':>9} {'gpu ms':>9} {'x floor':>8}")
    for r in rows:
        print(f"{r['preset']:10} {r['pdl']:3} {r.get('knobs', ''):24} {r['what']:8} {r.get('batch', r.get('tokens', '')):>5} {r['wall_ms_median']:9.3f} "
              f"{r['gpu_ms_median']:9.3f} {r.get('ratio_to_floor', float('nan')):8.2f}")


if __name__ == "__main__":
    main()
