"""Per-kernel totals from an `ncu --csv --metrics gpu__time_duration.sum` log (bench/profile_step.py).

  python bench/ncu_summary.py ncu_b1.csv
"""
from __future__ import annotations

import collections
import csv
import sys

TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def short_name(full: str) -> str:
    """`void oi::<unnamed>::gemv_kernel<1, 1, 0>(GemvArgs, int, int)` -> `gemv_kernel<1, 1, 0>`."""
    name = full.removeprefix("void ")
    for anon in ("(anonymous namespace)::", "<unnamed>::", "unnamed>::"):
        name = name.replace(anon, "")
    name = name[:name.index(">(") + 1] if ">(" in name else name.split("(")[0]  # drop the parameters
    scope = name.split("<")[0].rfind("::")
    return name[scope + 2:] if scope >= 0 else name


def main(path: str) -> None:
    rows = list(csv.reader(open(path)))
    start = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    head = rows[start]
    k, m, v, u = (head.index(c) for c in ("Kernel Name", "Metric Name", "Metric Value", "Metric Unit"))
    seq = [(short_name(r[k]), float(r[v].replace(",", "")) * TO_US.get(r[u], 1.0))
           for r in rows[start + 1:] if len(r) > v and r[m] == "gpu__time_duration.sum"]
    per: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for name, us in seq:
        per[name][0] += 1
        per[name][1] += us
    print(f"{len(seq)} kernels, {sum(us for _, us in seq):.1f} us in total")
    for name, (n, total) in sorted(per.items(), key=lambda x: -x[1][1]):
        print(f"{name:48s} x{n:<4d} {total:10.1f} us  {total / n:8.1f} us each")
    print("first 12 launches:", ", ".join(f"{name} {us:.1f}" for name, us in seq[:12]))


if __name__ == "__main__":
    main(sys.argv[1])
