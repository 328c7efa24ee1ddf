#!/usr/bin/env python3
"""Plot a soak's time series (bench/soak.py --out) as one self-contained SVG: RSS (with the bound
after the warm-up), KV blocks used, TTFT p99, TPOT p99 and unexpected errors per sample, against time.
Hand-written SVG, no plotting library.

    python3 bench/soak_plot.py soak.json docs/soak-qwen3-4b.svg
"""
from __future__ import annotations

import json
import math
import sys
from html import escape

from soak import RSS_GROWTH

PANELS = [("rss_mib", "RSS, MiB"), ("kv_blocks_used", "KV blocks used"), ("ttft_p99_ms", "TTFT p99, ms"),
          ("tpot_p99_ms", "TPOT p99, ms"), ("errors", "unexpected errors")]
W, LEFT, RIGHT, TOP, PANEL_H, GAP = 760, 64, 16, 58, 96, 26


def panel(i: int, key: str, title: str, doc: dict, t_end: float) -> list[str]:
    s, warm = doc["samples"], doc["config"]["warmup_s"]
    pts = [(x["t"], x[key]) for x in s if x.get(key) is not None]
    ys = [y for _, y in pts] or [0.0]
    lo, hi = 0.0, max(ys) or 1.0
    bound = None
    if key == "rss_mib" and pts:  # a span of at least 2x the bound, so that noise looks flat and 5% does not
        warm_peak = max((y for t, y in pts if t <= warm), default=None)
        bound = warm_peak and warm_peak * (1 + RSS_GROWTH)
        lo, hi = min(ys), max(ys + [bound or 0])
        pad = max(0.0, 2 * RSS_GROWTH * lo - (hi - lo)) / 2
        lo, hi = lo - pad, hi + pad
    y0, pw = TOP + i * (PANEL_H + GAP), W - LEFT - RIGHT
    X = lambda t: LEFT + pw * t / t_end  # noqa: E731
    Y = lambda v: y0 + PANEL_H * (1 - (v - lo) / ((hi - lo) or 1))  # noqa: E731
    out = [f'<text x="{LEFT}" y="{y0 - 6}" class="t">{title}</text>',
           f'<rect x="{LEFT}" y="{y0}" width="{X(min(warm, t_end)) - LEFT:.1f}" height="{PANEL_H}" fill="#f1f1f1"/>',
           f'<rect x="{LEFT}" y="{y0}" width="{pw}" height="{PANEL_H}" fill="none" stroke="#999"/>',
           f'<text x="{LEFT - 4}" y="{y0 + 10}" class="r">{hi:.4g}</text>',
           f'<text x="{LEFT - 4}" y="{y0 + PANEL_H}" class="r">{lo:.4g}</text>']
    if bound:
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{Y(bound):.1f}" y2="{Y(bound):.1f}" stroke="#c33" '
                   f'stroke-dasharray="4 3"/><text x="{LEFT + pw - 4}" y="{Y(bound) - 3:.1f}" class="r">'
                   f'bound +{RSS_GROWTH:.0%}</text>')
    if key == "errors":
        bw = max(1.0, pw / max(len(s), 1) * 0.8)
        out += [f'<rect x="{X(t) - bw / 2:.1f}" y="{Y(v):.1f}" width="{bw:.1f}" height="{Y(0) - Y(v):.1f}" '
                f'fill="#c33"/>' for t, v in pts if v]
    elif pts:
        line = " ".join(f"{X(t):.1f},{Y(v):.1f}" for t, v in pts)
        out.append(f'<polyline points="{line}" fill="none" stroke="#1f5fa8" stroke-width="1.5"/>')
    return out


def tick_step(span: float) -> float:
    """1, 2 or 5 times a power of ten: about five ticks over the span."""
    step = 10 ** math.floor(math.log10(span / 5))
    return next(m * step for m in (1, 2, 5, 10) if span / (m * step) <= 6)


def svg(doc: dict) -> str:
    c, s = doc["config"], doc["samples"]
    t_end = max([x["t"] for x in s] + [1.0])
    h = TOP + len(PANELS) * (PANEL_H + GAP) + 10
    verdict = "PASS" if doc["passed"] else "FAIL: " + "; ".join(doc["failures"])
    head = (f"soak: {doc['duration_s']:g} s at {c['rate']:g} req/s, {sum(doc['counts'].values())} requests, "
            f"max_model_len {c['max_model_len']}; shaded: the warm-up ({c['warmup_s']:g} s)")
    body = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h}" viewBox="0 0 {W} {h}" '
            'font-family="sans-serif" font-size="11">',
            "<style>.t{font-weight:bold}.r{text-anchor:end}.m{text-anchor:middle}</style>",
            f'<rect width="{W}" height="{h}" fill="white"/>',
            f'<text x="{LEFT}" y="16">{escape(head)}</text>',
            f'<text x="{LEFT}" y="30" fill="{"#286e28" if doc["passed"] else "#c33"}">{escape(verdict[:160])}</text>']
    for i, (key, title) in enumerate(PANELS):
        body += panel(i, key, title, doc, t_end)
    y, step = TOP + len(PANELS) * (PANEL_H + GAP) - GAP + 14, tick_step(t_end)
    body += [f'<text x="{LEFT + (W - LEFT - RIGHT) * k * step / t_end:.1f}" y="{y}" class="m">{k * step:g} s</text>'
             for k in range(int(t_end / step) + 1)]
    return "\n".join(body + ["</svg>"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    with open(argv[1], "w") as f:
        f.write(svg(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
