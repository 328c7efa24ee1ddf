#!/usr/bin/env python3
"""Plot a QPS sweep (the combined JSON from run_serving_bench.sh): output tok/s, TTFT p50/p99 and
TPOT p50/p99 against offered QPS.

    python3 bench/plot_sweep.py bench/results/TAG-sweep.json docs/TAG-sweep.png

matplotlib is a bench-only dependency (pip install matplotlib).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    sweep = json.load(open(argv[0]))
    pts = sorted((p for p in sweep["points"] if p["kind"] == "qps"), key=lambda p: p["value"])
    if not pts:
        print("no qps points in sweep", file=sys.stderr)
        return 1
    x = [p["value"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(x, [p["output_throughput"] for p in pts], "o-", label="output tok/s")
    ax.set_ylabel("output tokens / s")
    ax2 = ax.twinx()
    ax2.plot(x, [p["request_throughput"] for p in pts], "s--", color="gray", label="achieved req/s")
    ax2.plot(x, x, ":", color="lightgray", label="offered req/s")
    ax2.set_ylabel("requests / s")
    ax.set_title("Throughput")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    for ax, metric, title in ((axes[1], "ttft", "TTFT"), (axes[2], "tpot", "TPOT")):
        ax.plot(x, [p[f"median_{metric}_ms"] for p in pts], "o-", label="p50")
        ax.plot(x, [p[f"p99_{metric}_ms"] for p in pts], "^-", label="p99")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.legend(fontsize=8)
        if metric == "ttft":
            ax.set_yscale("log")
    for ax in axes:
        ax.set_xlabel("offered QPS (Poisson)")
        ax.grid(alpha=0.3)
    sat = sweep.get("saturated_at_qps")
    conc = [p for p in sweep["points"] if p["kind"] == "conc"]
    sub = f"{sweep.get('tag', '')}, {sweep.get('point_seconds', '?'):g} s/point"
    if sat:
        sub += f", saturated at {sat:g} QPS"
    if conc:
        sub += "; closed loop " + ", ".join(f"c={p['value']}: {p['output_throughput']:.0f} tok/s"
                                            for p in sorted(conc, key=lambda p: p["value"]))
    gpus = (sweep.get("machine") or {}).get("gpus") or []
    if gpus:
        sub += f" ({gpus[0].split(',')[0]})"
    fig.suptitle(sub, fontsize=10)
    fig.tight_layout()
    fig.savefig(argv[1], dpi=120)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
