"""Where a replayed decode step's time goes, from a kernel timeline (bench/profile_step.py --graph --trace).

  python bench/profile_step.py --graph --steps 4 --trace step.json
  python bench/timeline_summary.py step.json

Under programmatic dependent launch a kernel starts before its predecessor ends, so durations overlap;
what each kernel adds to the step is its end minus the latest end before it (the marginal time), and
the marginals of a step sum to its span.
"""
from __future__ import annotations

import collections
import gzip
import json
import sys

from ncu_summary import short_name


def split_steps(kern: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """(start ns, duration ns, short name) sorted by start -> decode steps. A step begins with the
    embedding lookup; a second embedding kernel inside the step gathers the sampled rows."""
    steps, cur = [], []
    for k in kern:
        if "embedding" in k[2] and cur and "sample" in cur[-1][2]:
            steps.append(cur)
            cur = []
        cur.append(k)
    steps.append(cur)
    return [s for s in steps if any("embedding" in k[2] for k in s)]


def marginals(steps) -> tuple[list[float], dict, dict]:
    """Spans (us) of the steps, and per "kernel after kernel" the durations and marginal times (us):
    a kernel's end minus the latest end before it (0 when it ends inside its predecessor). A step's
    marginals add up to its span."""
    marg, dur = collections.defaultdict(list), collections.defaultdict(list)
    for s in steps:
        prev_end, prev = s[0][0], "step start"
        for st, d, short in s:
            name, prev = f"{short} after {prev}", short  # o and down share one kernel: told apart by what precedes
            end = st + d
            marg[name].append(max(0, end - prev_end) / 1e3)
            dur[name].append(d / 1e3)
            prev_end = max(prev_end, end)
    spans = [(max(k[0] + k[1] for k in s) - s[0][0]) / 1e3 for s in steps]
    return spans, marg, dur


def main(path: str) -> None:
    events = json.load(gzip.open(path) if path.endswith(".gz") else open(path))["traceEvents"]  # ts, dur in us
    kern = sorted((int(e["ts"] * 1e3), int(e["dur"] * 1e3), short_name(e["name"])) for e in events
                  if e.get("cat") == "kernel")
    steps = split_steps(kern)
    spans, marg, dur = marginals(steps)
    n = len(steps)
    print(f"{n} steps, span us: " + ", ".join(f"{x:.1f}" for x in spans))
    print(f"{'kernel (after kernel)':72} {'per step':>8} {'mean us':>8} {'marginal us':>11} {'marginal/step':>13}")
    for name in sorted(marg, key=lambda k: -sum(marg[k])):
        c = len(marg[name]) / n
        print(f"{name[:72]:72} {c:8.0f} {sum(dur[name]) / len(dur[name]):8.2f} {sum(marg[name]) / len(marg[name]):11.2f} "
              f"{sum(marg[name]) / n:13.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
