"""Where a persistent batch-1 decode step's time goes (kernels/persistent.cu): the compute warps of every
block stamp the GPU's global timer at each phase boundary of one layer, the copy warp when it issues the
layer's first qkv and gate_up stages. Prints, per event, the spread over blocks in µs from the layer's
earliest start. Profiling only (device, 4B by default).

    python bench/persistent_trace.py [--preset qwen3-4b] [--ctx 1024] [--out trace.json]
"""
from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np

from bench_engine import Runner, model_dir

EVENTS = ["layer start", "qkv: staging starts", "qkv: x staged (from every block)", "qkv done (published)",
          "attention done", "o: staging starts", "o: attention staged (merged)", "o done", "gate_up: staging starts",
          "gate_up: x staged (after o)", "gate_up done", "down: staging starts", "down: act staged", "down done",
          "copy: first qkv stage", "copy: first gate_up stage", "copy: K/V stage requested", "copy: K/V stage issued",
          "copy: first o stage", *["(unused)"] * 3,
          "attn: first K/V stage landed", "attn: q, k, v prepared", "attn: first chunk's scores", "attn: first chunk done",
          "attn: keys done (P.V)",
          "attn: partial written", "attn: merged", "o warp 1: data ready", "(unused)", "o warp 1: MMAs done"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-4b")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import openinfer

    eng = openinfer.Engine(str(model_dir(a.preset)), device="cuda", load_format="random", max_model_len=a.ctx + 64,
                           max_num_seqs=8, gpu_memory_utilization=0.5)
    be = eng.llm_engine.backend
    r = Runner(be, eng.llm_engine.model_config.vocab_size)
    blocks = r.alloc(a.ctx + 16)
    r.step([(blocks, 0, a.ctx)])
    rows = []
    for k in range(5):
        args = r.args([(blocks, a.ctx + k, 1)])
        be.eng.persistent_trace(True)  # stamps eager persistent steps of this engine
        be.step(replace(args, force_eager=True))
        t = be.eng.persistent_trace(False).astype(np.int64)
        t = np.where(t > 0, (t - t[:, 0].min()) / 1e3, np.nan)
        rows.append(t)
    t = np.nanmedian(np.stack(rows), axis=0)  # [blocks, events] µs, median over steps per block
    print(f"{'event':28} {'min':>8} {'median':>8} {'max':>8}  (µs from the layer's earliest start; {t.shape[0]} blocks)")
    out = []
    for e, name in enumerate(EVENTS):
        col = t[:, e]
        col = col[np.isfinite(col)]  # events some blocks do not reach (attention items, merges)
        if not len(col):
            continue
        print(f"{name:28} {col.min():8.2f} {np.median(col):8.2f} {col.max():8.2f}")
        out.append(dict(event=name, min=float(col.min()), median=float(np.median(col)), max=float(col.max())))
    if a.out:
        json.dump(dict(preset=a.preset, ctx=a.ctx, events=out, per_block=t.tolist()), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
