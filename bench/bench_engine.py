"""Engine-level speed: decode step time by batch size at a given context, and prefill time.

Drives the CUDA backend's step() directly (no scheduler, no HTTP), so it measures the engine: wall time
per step (Python + metadata copy + GPU + result copy) and GPU time per step (CUDA events). Decode rows
also give the overlapped time per step: the same steps run as the server runs them, step i + 1 queued
(its tokens fed from step i on the device) before step i's result is read, timed between collects.

  python bench/bench_engine.py --preset qwen3-4b --ctx 1024 --batches 1,8,32,64 --out bench/results/engine.json

Weights come from the random load path (same speed as a checkpoint; 32B does not fit the disk anyway).
Floors: bytes read per decode step over the measured 4.21 TB/s copy rate of the H200 (QWEN3.md).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from openinfer.step import StepInput

FLOOR_MS = {"qwen3-4b": 1.91, "qwen3-8b": 3.59, "qwen3-32b": 15.2}


def provenance() -> dict:
    """The command, date, tree and machine a result comes from. The tree is the one the engine was built
    from (bench/build_wheel.sh, via device_setup.sh), else this checkout's."""
    commit = os.environ.get("OPENINFER_TREE", "")
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        pass
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip()
    except OSError:
        gpu = ""
    # experiment switches (OPENINFER_EXP_*, read by the engine): two runs of one command differ by these alone
    switches = {k: v for k, v in sorted(os.environ.items()) if k.startswith("OPENINFER_EXP_")}
    return {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit,
            "machine": {"gpu": gpu, "host": platform.node()}, "switches": switches}


def option_settings(options: str) -> list[tuple[str, dict]]:
    """'persistent_decode=0;persistent_decode=1' -> [(text, EngineConfig overrides), ...]: each setting
    builds its own engine, in turn, in this process (values are ints, floats or true/false)."""
    def value(v: str):
        if v.lower() in ("true", "false"):
            return v.lower() == "true"
        return float(v) if "." in v else int(v)
    return [(setting, {kv.split("=")[0]: value(kv.split("=")[1]) for kv in setting.split(",") if kv})
            for setting in options.split(";")]


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

    def args(self, seqs) -> StepInput:
        """seqs: list of (block ids, first new position, number of new tokens) -> the backend's StepInput
        (random token ids; the last token of each sequence samples)."""
        ids, pos, qsl, ctx, slots, sample = [], [], [0], [], [], []
        M = max(len(b) for b, _, _ in seqs)
        bt = np.zeros((len(seqs), M), np.int32)
        for i, (blocks, p0, n) in enumerate(seqs):
            ids.append(self.rng.integers(0, min(self.vocab, 151643), n, dtype=np.int32))
            pos.append(np.arange(p0, p0 + n, dtype=np.int32))
            b = np.asarray(blocks, np.int32)
            slots.append(b[pos[-1] // 16] * 16 + pos[-1] % 16)
            bt[i, :len(blocks)] = blocks
            qsl.append(qsl[-1] + n)
            ctx.append(p0 + n)
            sample.append(qsl[-1] - 1)
        S = len(sample)
        temp, top_p, top_k = self.sampling
        return StepInput(input_ids=np.concatenate(ids), positions=np.concatenate(pos),
                         query_start_loc=np.array(qsl, np.int32), context_lens=np.array(ctx, np.int32),
                         block_tables=bt, slot_mapping=np.concatenate(slots).astype(np.int32),
                         sample_idx=np.array(sample, np.int32), temperature=np.full(S, temp, np.float32),
                         top_p=np.full(S, top_p, np.float32), top_k=np.full(S, top_k, np.int32),
                         seeds=np.arange(S, dtype=np.uint64))

    def step(self, seqs):
        """One synchronous step: (wall ms, GPU ms)."""
        args = self.args(seqs)
        t0 = time.perf_counter()
        self.b.step(args)
        return (time.perf_counter() - t0) * 1e3, getattr(self.b, "last_gpu_ms", float("nan"))

    def overlapped(self, seqs_of, steps: int) -> tuple[list[float], list[np.ndarray]]:
        """Decode steps seqs_of(0..steps-1) (one token per sequence) as the server runs them: step i + 1
        is queued, its tokens fed on the device from step i, before step i's result is read. Returns
        the ms between consecutive collects (steps - 2 of them) and every step's sampled tokens."""
        first = seqs_of(0)
        feed = np.arange(len(first), dtype=np.int32)  # row b takes the previous step's row-b token
        self.b.launch(self.args(first))
        done, tokens = [], []
        for i in range(1, steps):
            self.b.launch(replace(self.args(seqs_of(i)), prev_rows=feed))
            tokens.append(self.b.collect().tokens)
            done.append(time.perf_counter())
        tokens.append(self.b.collect().tokens)
        return [(b - a) * 1e3 for a, b in zip(done, done[1:])], tokens


def bench_preset(preset: str, ctx: int, batches: list[int], steps: int, prefill_lens: list[int], pdl: str,
                 sampling: str = "greedy", options: dict | None = None) -> list[dict]:
    import openinfer

    t0 = time.perf_counter()
    # --options may set any of these too (max_model_len=40960: the split counts a server's graphs are sized for)
    kw = dict(device="cuda", load_format="random", max_num_seqs=max(batches, default=1),
              max_model_len=max(ctx + 2 * steps + 16, max(prefill_lens) + 16), pdl=pdl != "0")
    eng = openinfer.Engine(str(model_dir(preset)), **{**kw, **(options or {})})
    init_s = time.perf_counter() - t0
    r = Runner(eng.llm_engine.backend, eng.llm_engine.model_config.vocab_size, sampling=sampling)
    rows = []
    # prefill: one prompt of each length, one step each
    blocks = r.alloc(max(prefill_lens))
    for n in prefill_lens:
        for _ in range(2):
            r.step([(blocks, 0, n)])
        pre = [r.step([(blocks, 0, n)]) for _ in range(5)]
        rows.append({"preset": preset, "pdl": pdl, "what": "prefill", "tokens": n,
                     "wall_ms_median": statistics.median(w for w, _ in pre),
                     "gpu_ms_median": statistics.median(g for _, g in pre), "engine_init_s": init_s})
        print(json.dumps(rows[-1]), flush=True)
    for B in batches:
        seqs = [r.alloc(ctx + 2 * steps + 2) for _ in range(B)]
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
        # the same steps overlapped, on the positions after the synchronous ones
        over = r.overlapped(lambda i: [(s, ctx - 1 + steps + i, 1) for s in seqs], steps)[0][3:]
        row = {"preset": preset, "pdl": pdl, "what": "decode", "sampling": sampling, "batch": B, "ctx": ctx,
               "steps": len(walls),
               "wall_ms_median": statistics.median(walls), "gpu_ms_median": statistics.median(gpus),
               "wall_ms_p90": float(np.percentile(walls, 90)), "overlapped_ms_median": statistics.median(over)}
        row["cpu_overhead_ms"] = row["wall_ms_median"] - row["gpu_ms_median"]
        if B == 1 and preset in FLOOR_MS:
            row["floor_ms"] = FLOOR_MS[preset]
            row["ratio_to_floor"] = row["wall_ms_median"] / FLOOR_MS[preset]
            row["overlapped_ratio_to_floor"] = row["overlapped_ms_median"] / FLOOR_MS[preset]
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
    ap.add_argument("--prefill-len", default="1024", help="comma-separated prompt lengths, each one prefill step")
    ap.add_argument("--options", default="", help="EngineConfig settings to compare, as 'name=value,...'; settings "
                    "separated by ';' each build an engine, in turn, in this process (e.g. "
                    "'persistent_decode=false;persistent_decode=true')")
    ap.add_argument("--sampling", default="greedy", choices=sorted(SAMPLING),
                    help="greedy, or qwen: temperature 0.6, top_p 0.95, top_k 20 (the releases' defaults)")
    ap.add_argument("--pdl", default="1", help="programmatic dependent launch: 1, 0, or 1,0 for an A/B")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",") if x]
    prefill_lens = [int(x) for x in a.prefill_len.split(",")]
    rows = []
    for preset in a.preset.split(","):
        for setting, options in option_settings(a.options):
            for pdl in a.pdl.split(","):
                got = bench_preset(preset, a.ctx, batches, a.steps, prefill_lens, pdl, a.sampling, options)
                for r in got:
                    r["options"] = setting
                rows += got
    result = dict(provenance(), rows=rows)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'preset':10} {'pdl':3} {'options':24} {'what':8} {'batch':>5} {'wall ms':>9} {'gpu ms':>9} {'x floor':>8} "
          f"{'overlap ms':>10}")
    for r in rows:
        print(f"{r['preset']:10} {r['pdl']:3} {r.get('options', ''):24} {r['what']:8} {r.get('batch', r.get('tokens', '')):>5} {r['wall_ms_median']:9.3f} "
              f"{r['gpu_ms_median']:9.3f} {r.get('ratio_to_floor', float('nan')):8.2f} "
              f"{r.get('overlapped_ms_median', float('nan')):10.3f}")


if __name__ == "__main__":
    main()
