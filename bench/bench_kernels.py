"""Kernel timings at Qwen3 decode shapes, cold L2, medians: the fused small-batch GEMM against
rmsnorm/silu + cuBLASLt, as % of the bandwidth floor (weight bytes / 4.21 TB/s).

  python bench/bench_kernels.py --out bench/results/kernels.json
"""
from __future__ import annotations

import argparse
import json

BW = 4.21e12  # measured device-to-device copy rate of the lent H200 (BENCHMARKS.md)
SHAPES = {  # name: (N, K, prologue, epilogue); prologue 1 = RMSNorm; epilogue 1 = residual add, 2 = fp32, 3 = SiLU·up
    "4b.qkv": (6144, 2560, 1, 0), "4b.o": (2560, 4096, 0, 1), "4b.gate_up": (19456, 2560, 1, 3),
    "4b.down": (2560, 9728, 0, 1), "4b.lm_head": (151936, 2560, 1, 2),
    "32b.gate_up": (51200, 5120, 1, 3), "32b.down": (5120, 25600, 0, 1),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    from openinfer import _engine

    rows = []
    print(f"{'shape':14} {'M':>2} {'floor us':>9} {'fused us':>9} {'cublas us':>9} {'fused %':>8} {'cublas %':>8}")
    for name, (N, K, pro, epi) in SHAPES.items():
        for M in (int(m) for m in a.rows.split(",")):
            floor = N * K * 2 / BW * 1e6
            fused = _engine.ops.bench_linear(M, N, K, pro, epi, True, a.reps)
            lt = _engine.ops.bench_linear(M, N, K, pro, epi, False, a.reps)
            r = {"shape": name, "M": M, "floor_us": floor, "fused_us": fused if fused > 0 else None, "cublas_us": lt}
            rows.append(r)
            fp = f"{100 * floor / fused:7.0f}%" if fused > 0 else "     n/a"
            print(f"{name:14} {M:2d} {floor:9.1f} {fused:9.1f} {lt:9.1f} {fp} {100 * floor / lt:7.0f}%", flush=True)
    if a.out:
        json.dump({"command": "python bench/bench_kernels.py", "rows": rows}, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
