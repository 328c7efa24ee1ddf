"""Kernel timings at Qwen3 decode shapes, cold L2, medians: the fused small-batch GEMM against
rmsnorm/silu + cuBLASLt, as % of the bandwidth floor (weight bytes / 4.21 TB/s). With --chain: the
decode step's four projections x all layers in one CUDA graph (the weight stream without attention).
The timings come from openinfer._bench (bench/cuda/kernels.cpp), built with -DOPENINFER_BENCH=ON.

  python bench/bench_kernels.py --out bench/results/kernels.json
  python bench/bench_kernels.py --chain 4b,8b --rows 1,2 --pdl 1,0 --variants 'kernel=0;kernel=1'
  python bench/bench_kernels.py --attention 1x1024,1x8192,8x1024,64x1024 --splits 0,1,4,16,64 \
      --variants 'key_warps=0;key_warps=1'
  python bench/bench_kernels.py --gemm-chain 4b,8b --rows 1,8,16,32,64,256 --configs=-2,-1,0,1,2,3
  python bench/bench_kernels.py --gemm-chain 4b,8b --rows 1,8,16,32,64 --configs=-2,-3
  python bench/bench_kernels.py --prefill-attention 1024,8192,1024@31744 --model 4b --wgmma 0,1
  python bench/bench_kernels.py --gemm-chain 4b,8b --rows 1,8,32,64,256,1024 --configs=-2,-1,-4
  python bench/bench_kernels.py --gemm-chain 4b,8b --rows 128,256,1024,2500 --configs=-2,-1 --invariant-chunks 0,1,2,4
"""
from __future__ import annotations

import argparse
import json

BW = 4.21e12  # measured device-to-device copy rate of the lent H200 (BENCHMARKS.md)
SHAPES = {  # name: (N, K, prologue, epilogue); prologue 1 = RMSNorm; epilogue 1 = residual add, 2 = fp32, 3 = SiLU·up
    "4b.qkv": (6144, 2560, 1, 0), "4b.o": (2560, 4096, 0, 1), "4b.gate_up": (19456, 2560, 1, 3),
    "4b.down": (2560, 9728, 0, 1), "4b.lm_head": (151936, 2560, 1, 2), "8b.o": (4096, 4096, 0, 1),
    "8b.down": (4096, 12288, 0, 1), "8b.qkv": (6144, 4096, 1, 0), "8b.gate_up": (24576, 4096, 1, 3),
    "32b.gate_up": (51200, 5120, 1, 3), "32b.down": (5120, 25600, 0, 1),
}
CHAINS = {  # one decoder layer's projections (qkv, o, gate_up, down) and the layer count
    "4b": ([(6144, 2560, 1, 0), (2560, 4096, 0, 1), (19456, 2560, 1, 3), (2560, 9728, 0, 1)], 36),
    "8b": ([(6144, 4096, 1, 0), (4096, 4096, 0, 1), (24576, 4096, 1, 3), (4096, 12288, 0, 1)], 36),
    "32b": ([(10240, 5120, 1, 0), (5120, 8192, 0, 1), (51200, 5120, 1, 3), (5120, 25600, 0, 1)], 64),
}


def variant_settings(variants: str) -> list[tuple[str, dict]]:
    """'key_warps=0;key_warps=1' -> [(text, keyword arguments of the harness), ...]."""
    return [(v, {kv.split("=")[0]: int(kv.split("=")[1]) for kv in v.split(",") if kv}) for v in variants.split(";")]


def attention(a, bench) -> list:
    """Decode attention (4B heads: 32 query, 8 KV), one launch per layer of 36 in a graph."""
    rows = []
    print(f"{'variant':24} {'batch':>5} {'ctx':>6} {'splits':>6} {'KV MB':>7} {'us':>8} {'GB/s':>7}")
    for setting, kw in variant_settings(a.variants):
        for case in a.attention.split(","):
            B, ctx = (int(v) for v in case.split("x"))
            for sp in (int(v) for v in a.splits.split(",")):
                us, used = bench.attention(B, ctx, 32, 8, 36, sp, a.reps, **kw)
                mb = B * ctx * 8 * 128 * 2 * 2 / 1e6
                rows.append({"variant": setting, "batch": B, "ctx": ctx, "splits": used, "kv_mb": mb, "us": us})
                print(f"{setting:24} {B:5d} {ctx:6d} {used:6d} {mb:7.1f} {us:8.2f} {mb * 1e3 / us:7.0f}", flush=True)
    return rows


HEADS = {"0.6b": (16, 8), "4b": (32, 8), "8b": (32, 8), "32b": (64, 8)}  # (query heads, KV heads)


def prefill_attention(a, bench) -> list:
    """A prompt chunk's causal attention (T tokens after a cached prefix; cases T or T@prefix), one launch per layer
    of 36 in a graph, per kernel: --wgmma 0 the mma.sync kernel, 1 the Hopper wgmma experiment (attention_sm90.cu).
    TFLOP/s counts the products done by a causal kernel: 4 x 128 x heads per (query row, visible key)."""
    nH, nKV = HEADS[a.model]
    rows = []
    print(f"{'model':5} {'T':>6} {'prefix':>6} {'wgmma':>5} {'ran':>4} {'us/layer':>9} {'TFLOP/s':>8} {'speedup':>8}")
    for case in a.prefill_attention.split(","):
        T, prefix = (int(v) for v in case.split("@")) if "@" in case else (int(case), 0)
        flops = 4 * 128 * nH * (T * prefix + T * (T + 1) // 2)
        base = None
        for mode in (int(v) for v in a.wgmma.split(",")):
            us, ran = bench.prefill_attention(T, prefix, nH, nKV, 36, a.reps, mode)
            base = base or us
            rows.append({"model": a.model, "T": T, "prefix": prefix, "wgmma": mode, "ran_wgmma": ran, "us": us,
                         "tflops": flops / us / 1e6})
            print(f"{a.model:5} {T:6d} {prefix:6d} {mode:5d} {str(ran):>4} {us:9.2f} {flops / us / 1e6:8.1f} "
                  f"{base / us:7.2f}x", flush=True)
    return rows


def chain(a, bench) -> list:
    """The GEMV chain per model and row count, for each PDL setting asked for."""
    rows = []
    print(f"{'variant':16} {'model':6} {'M':>2} {'pdl':>3} {'floor us':>9} {'graph us':>9} {'% floor':>8} {'us/layer':>9}")
    for setting, kw in variant_settings(a.variants):
        for model in a.chain.split(","):
            # a SHAPES name: that projection alone, 36 times in a row (one projection's share of a chain)
            shapes, layers = CHAINS[model] if model in CHAINS else ([SHAPES[model]], 36)
            floor = sum(n * k * 2 for n, k, _, _ in shapes) * layers / BW * 1e6
            for M in (int(m) for m in a.rows.split(",")):
                for pdl in (int(v) for v in a.pdl.split(",")):
                    bench.set_pdl(bool(pdl))
                    us = bench.gemv_chain(M, shapes, layers, a.reps, **kw)
                    rows.append({"variant": setting, "model": model, "M": M, "pdl": pdl, "floor_us": floor, "graph_us": us,
                                 "layers": layers})
                    print(f"{setting:16} {model:6} {M:2d} {pdl:3d} {floor:9.1f} {us:9.1f} {100 * floor / us:7.0f}% "
                          f"{us / layers:9.2f}", flush=True)
    bench.set_pdl(True)
    return rows


def gemm_chain(a, bench) -> list:
    """A decode step's GEMMs (the four projections x all layers, one graph) per model, row count and GEMM:
    cuBLASLt (-2) against skinny_gemm (-3: wgmma + TMA, 1-64 rows), the engine's batch-invariant path (-1:
    skinny_gemm's invariant mode), fixed_gemm as its launcher picks (-4) and its families (0-3); config -1 once per
    --invariant-chunks value (0: the engine's path, 1/2/4: skinny_gemm_invariant with that many 64-row chunks per
    block, the same bits)."""
    rows = []
    inv_chunks = [int(c) for c in a.invariant_chunks.split(",")]
    print(f"{'model':6} {'M':>4} {'config':>6} {'chunks':>6} {'floor us':>9} {'graph us':>9} {'% floor':>8}")
    for model in a.gemm_chain.split(","):
        # a SHAPES name: that projection alone, 36 times in a row
        shapes, layers = CHAINS[model] if model in CHAINS else ([SHAPES[model]], 36)
        nk = [(n, k) for n, k, _, _ in shapes]
        floor = sum(n * k * 2 for n, k in nk) * layers / BW * 1e6
        for M in (int(m) for m in a.rows.split(",")):
            for config in (int(c) for c in a.configs.split(",")):
                for chunks in inv_chunks if config == -1 else [0]:
                    us = bench.gemm_chain(M, nk, layers, a.reps, config, chunks)
                    rows.append({"model": model, "M": M, "config": config, "invariant_chunks": chunks,
                                 "floor_us": floor, "graph_us": us})
                    print(f"{model:6} {M:4d} {config:6d} {chunks:6d} {floor:9.1f} {us:9.1f} {100 * floor / us:7.0f}%",
                          flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=None, help="row counts (default 1,2,4,8; --chain: 1,2, the fused GEMV's)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    ap.add_argument("--chain", default=None, help="models (4b,8b,32b) or SHAPES names (one projection 36 times): "
                    "time the GEMV chain instead")
    ap.add_argument("--attention", default=None, help="BxCTX cases: time decode attention instead")
    ap.add_argument("--gemm-chain", default=None, help="models (4b,8b,32b) or SHAPES names (one projection 36 times): "
                    "time a step's GEMMs in a graph, cuBLASLt against skinny_gemm and the batch-invariant GEMM's "
                    "families (--configs)")
    ap.add_argument("--configs", default="-2,-1", help="--gemm-chain: -4 fixed_gemm's pick, -3 skinny_gemm (wgmma + TMA, "
                    "1-64 rows; cuBLASLt above), -2 cuBLASLt, -1 the engine's batch-invariant path (skinny_gemm's "
                    "invariant mode, fixed_gemm where it refuses), 0-3 a fixed_gemm family")
    ap.add_argument("--invariant-chunks", default="0", help="--gemm-chain config -1: 0 the engine's path, 1, 2, 4 "
                    "skinny_gemm_invariant with that many 64-row chunks per block")
    ap.add_argument("--prefill-attention", default=None, help="prompt chunk cases T or T@prefix (e.g. 1024,8192,"
                    "1024@31744): time prefill attention, --wgmma kernels, --model heads")
    ap.add_argument("--wgmma", default="0,1", help="--prefill-attention: 0 the mma.sync kernel, 1 the wgmma kernel (the engine's)")
    ap.add_argument("--model", default="4b", help="--prefill-attention: 0.6b, 4b, 8b or 32b heads")
    ap.add_argument("--splits", default="0", help="split counts for --attention (0: the launch heuristic)")
    ap.add_argument("--pdl", default="1", help="--chain: programmatic dependent launch settings to time (1,0)")
    ap.add_argument("--variants", default="", help="--attention (key_warps, cluster_cap), --chain (kernel: 0 auto, 1 CUDA "
                    "cores, 2 CUDA cores with bf16 input, 3 tensor cores): settings separated by ';', timed in turn")
    a = ap.parse_args()
    a.rows = a.rows or ("1,2" if a.chain else "1,2,4,8")
    from openinfer import _bench

    if a.prefill_attention:
        rows = prefill_attention(a, _bench)
        if a.out:
            json.dump({"command": f"python bench/bench_kernels.py --prefill-attention {a.prefill_attention} --model "
                       f"{a.model} --wgmma {a.wgmma}", "rows": rows}, open(a.out, "w"), indent=1)
        return
    if a.gemm_chain:
        rows = gemm_chain(a, _bench)
        if a.out:
            json.dump({"command": f"python bench/bench_kernels.py --gemm-chain {a.gemm_chain} --rows {a.rows} "
                       f"--configs={a.configs} --invariant-chunks {a.invariant_chunks}", "rows": rows}, open(a.out, "w"), indent=1)
        return
    if a.chain or a.attention:
        rows = chain(a, _bench) if a.chain else attention(a, _bench)
        if a.out:
            json.dump({"command": "python bench/bench_kernels.py " + (f"--chain {a.chain} --rows {a.rows} --pdl {a.pdl}" if a.chain else
                       f"--attention {a.attention} --splits {a.splits} --variants '{a.variants}'"), "rows": rows}, open(a.out, "w"),
                      indent=1)
        return

    rows = []
    print(f"{'shape':14} {'M':>2} {'floor us':>9} {'fused us':>9} {'cublas us':>9} {'fused %':>8} {'cublas %':>8}")
    for name, (N, K, pro, epi) in SHAPES.items():
        for M in (int(m) for m in a.rows.split(",")):
            floor = N * K * 2 / BW * 1e6
            fused = _bench.linear(M, N, K, pro, epi, True, a.reps)
            lt = _bench.linear(M, N, K, pro, epi, False, a.reps)
            r = {"shape": name, "M": M, "floor_us": floor, "fused_us": fused if fused > 0 else None, "cublas_us": lt}
            rows.append(r)
            fp = f"{100 * floor / fused:7.0f}%" if fused > 0 else "     n/a"
            print(f"{name:14} {M:2d} {floor:9.1f} {fused:9.1f} {lt:9.1f} {fp} {100 * floor / lt:7.0f}%", flush=True)
    if a.out:
        json.dump({"command": "python bench/bench_kernels.py", "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
