#!/usr/bin/env python3
"""Overload: offered load past saturation (issue #26 item 4). Every request must either complete or be
refused at once with a 503 that carries Retry-After, and the TTFT of those admitted must stay bounded
(the waiting queue is bounded, so it plateaus instead of growing with the run).

    python3 bench/overload.py --serve-args "--model-path models/qwen3-4b-random" --factor 2 --seconds 60 --out overload.json
    python3 bench/overload.py --url http://127.0.0.1:8000 --saturation 40 --out overload.json

Two phases on one request shape (--prompt-len random token ids, --output-len tokens, streamed,
ignore_eos): first the saturation rate, measured closed-loop (--concurrency clients, each sending its
next request when the last one ends, for --measure-s; completions per second) unless --saturation
gives it; then Poisson arrivals at --factor times that rate for --seconds. Answers are classified:
  done     200, a stream that ends with [DONE] (its TTFT: request sent -> first token's chunk);
  refused  503 queue_full with an integer Retry-After >= 1 (its answer time: sent -> status line);
  error    anything else (another status, an SSE error event, no [DONE], a transport error).
It fails (exit 1, reasons printed) on: any error; a refusal answered later than --refuse-ms (100);
nothing refused (the load did not overload); the TTFT p99 of requests sent in the last third of the
run more than --growth (1.5) times that of the second third, plus 50 ms (a queue that grows without
bound); KV blocks or requests not back to 0 --drain-s after the traffic stops; a server it started that
does not exit 0 on SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

from soak import IDLE, gauges, pct, run_checked  # noqa: E402  (bench/ is on the path)


class Outcomes:
    def __init__(self):
        self.done, self.refused, self.errors = [], [], []  # (sent s, TTFT or answer ms) / (sent, ms) / text

    async def send(self, client, body: bytes, t_run: float) -> None:
        t0 = time.perf_counter()
        sent = t0 - t_run
        try:  # the body encoded beforehand and the events after the first read by substring: the client's
            # own loop (thousands of SSE lines a second) must not be what delays the answers it times
            async with client.stream("POST", "/v1/completions", content=body, headers=JSON_HEADERS) as r:
                t_head = time.perf_counter()
                if r.status_code == 503:
                    err = json.loads(await r.aread()).get("error") or {}
                    ra = r.headers.get("retry-after", "")
                    if err.get("code") != "queue_full" or not ra.isdigit() or int(ra) < 1:
                        raise ValueError(f"503 {err.get('code')} Retry-After {ra!r}")
                    self.refused.append((sent, (t_head - t0) * 1e3))
                    return
                if r.status_code != 200:
                    raise ValueError(f"{r.status_code} {(await r.aread())[:200]!r}")
                t_first = None
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        break
                    if line.startswith("data: ") and (t_first is None or '"error"' in line):
                        ev = json.loads(line[6:])
                        if "error" in ev:
                            raise ValueError(f"error event {ev['error']}")
                        if t_first is None and (ev.get("choices") or [{}])[0].get("text"):
                            t_first = time.perf_counter()
                else:
                    raise ValueError("the stream ended without [DONE]")
                self.done.append((sent, ((t_first or time.perf_counter()) - t0) * 1e3))
        except Exception as e:
            self.errors.append(f"at {sent:.2f} s: {type(e).__name__}: {e}"[:300])


JSON_HEADERS = {"content-type": "application/json"}


def body_of(rng: random.Random, a) -> bytes:
    return json.dumps({"prompt": [rng.randrange(1000, 100_000) for _ in range(a.prompt_len)],
                       "max_tokens": a.output_len, "ignore_eos": True, "stream": True, "temperature": 0}).encode()


async def loop_lag(samples: list, stop: asyncio.Event, period: float = 0.01) -> None:
    """How late this client's event loop wakes (ms): a late loop delays the answers it times."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        samples.append((time.perf_counter() - t - period) * 1e3)


async def saturation(client, a) -> float:
    """Completions per second with --concurrency clients each sending back to back (closed loop)."""
    rng, out, end = random.Random(a.seed + 1), Outcomes(), time.perf_counter() + a.measure_s
    t0 = time.perf_counter()

    async def worker():
        while time.perf_counter() < end:
            await out.send(client, body_of(rng, a), t0)

    await asyncio.gather(*(worker() for _ in range(a.concurrency)))
    if out.errors or out.refused:
        raise SystemExit(f"overload: the saturation run was refused or failed: {(out.errors + out.refused)[:3]}")
    return len(out.done) / (time.perf_counter() - t0)


async def run(a, url: str, pid: int | None = None) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(a.stuck_s, connect=10), trust_env=False,
                                 limits=httpx.Limits(max_connections=4096, max_keepalive_connections=512)) as client:
        sat = a.saturation or await saturation(client, a)
        rate, rng, out, tasks = a.factor * sat, random.Random(a.seed), Outcomes(), set()
        gaps, t = [], 0.0
        while (t := t + rng.expovariate(rate)) < a.seconds:
            gaps.append(t)
        bodies = [body_of(rng, a) for _ in gaps]
        lag, stop_lag = [], asyncio.Event()
        lag_task = asyncio.create_task(loop_lag(lag, stop_lag))
        t0 = time.perf_counter()
        for t_at, body in zip(gaps, bodies):
            await asyncio.sleep(max(0.0, t0 + t_at - time.perf_counter()))
            task = asyncio.create_task(out.send(client, body, t0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        stuck = len((await asyncio.wait(tasks, timeout=a.stuck_s))[1]) if tasks else 0
        stop_lag.set()
        await lag_task
        deadline = time.perf_counter() + a.drain_s
        while True:
            try:
                final = await gauges(client)
            except httpx.HTTPError:
                final = {}
            if all(final.get(k) == 0 for k in IDLE) or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.25)
    third = a.seconds / 3
    ttft = lambda lo, hi: [ms for s, ms in out.done if lo <= s < hi]  # noqa: E731
    n = len(out.done) + len(out.refused) + len(out.errors)
    return {"config": {"url": url, "serve_args": a.serve_args, "factor": a.factor, "seconds": a.seconds,
                       "prompt_len": a.prompt_len, "output_len": a.output_len, "concurrency": a.concurrency,
                       "measure_s": a.measure_s, "seed": a.seed, "refuse_ms": a.refuse_ms, "growth": a.growth,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S")},
            "saturation_rps": sat, "saturation_measured": a.saturation is None, "offered_rps": rate,
            "requests": n, "done": len(out.done), "refused": len(out.refused), "errors_total": len(out.errors),
            "errors": out.errors[:50], "stuck": stuck, "final": final,
            "done_rps": len(out.done) / a.seconds,
            "ttft_ms": {"p50": pct([m for _, m in out.done], 0.5), "p99": pct([m for _, m in out.done], 0.99),
                        "p99_second_third": pct(ttft(third, 2 * third), 0.99),
                        "p99_last_third": pct(ttft(2 * third, a.seconds), 0.99)},
            "client_loop_lag_ms": {"p50": pct(lag, 0.5), "p99": pct(lag, 0.99), "max": max(lag, default=None)},
            "refusal_ms": {"p50": pct([m for _, m in out.refused], 0.5), "p99": pct([m for _, m in out.refused], 0.99),
                           "max": max((m for _, m in out.refused), default=None)}}


def check(doc: dict) -> list[str]:
    c, why = doc["config"], []
    if doc["errors_total"]:
        why.append(f"{doc['errors_total']} requests neither completed nor were refused; the first: {doc['errors'][0]}")
    if not doc["refused"]:
        why.append(f"nothing was refused at {doc['offered_rps']:.1f} req/s offered: not an overload")
    elif doc["refusal_ms"]["max"] > c["refuse_ms"]:
        why.append(f"a 503 took {doc['refusal_ms']['max']:.0f} ms (bound {c['refuse_ms']:g} ms)")
    t = doc["ttft_ms"]
    if t["p99_second_third"] is not None and t["p99_last_third"] is not None \
            and t["p99_last_third"] > c["growth"] * t["p99_second_third"] + 50:
        why.append(f"TTFT p99 grew from {t['p99_second_third']:.0f} ms (second third) to {t['p99_last_third']:.0f} "
                   f"ms (last third): the queue is not bounded")
    if doc["stuck"]:
        why.append(f"{doc['stuck']} requests still in flight after the traffic stopped")
    busy = {k: doc["final"].get(k) for k in IDLE if doc["final"].get(k) != 0}
    if busy:
        why.append(f"not idle after the drain: {busy}")
    if doc.get("server_exit") not in (None, 0):
        why.append(f"the server exited with status {doc['server_exit']} on SIGTERM")
    return why


def summary(doc: dict) -> str:
    t, r = doc["ttft_ms"], doc["refusal_ms"]
    f = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
    lines = [f"overload: saturation {doc['saturation_rps']:.2f} req/s "
             f"({'measured' if doc['saturation_measured'] else 'given'}), offered {doc['offered_rps']:.2f} req/s "
             f"for {doc['config']['seconds']:g} s: {doc['requests']} requests, {doc['done']} done "
             f"({doc['done_rps']:.2f}/s), {doc['refused']} refused, {doc['errors_total']} errors",
             f"  TTFT of the admitted p50 / p99 {f(t['p50'])} / {f(t['p99'])} ms (p99 second third {f(t['p99_second_third'])}, "
             f"last third {f(t['p99_last_third'])}); 503 answered in p50 / p99 / max {f(r['p50'])} / {f(r['p99'])} / "
             f"{f(r['max'])} ms; this client's loop late by p99 {f(doc.get('client_loop_lag_ms', {}).get('p99'))} ms"]
    return "\n".join(lines + ([f"FAIL: {w}" for w in doc["failures"]] or ["PASS"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one with --serve-args)")
    p.add_argument("--serve-args", help="openinfer-serve's arguments for the server this starts and stops")
    p.add_argument("--saturation", type=float, help="the saturation rate, req/s (default: measured first)")
    p.add_argument("--factor", type=float, default=2.0, help="offered load as a multiple of saturation (default 2)")
    p.add_argument("--seconds", type=float, default=60.0, help="length of the overload (default 60)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop clients measuring saturation (default 64)")
    p.add_argument("--measure-s", type=float, default=20.0, help="seconds of the saturation run (default 20)")
    p.add_argument("--refuse-ms", type=float, default=100.0, help="longest a 503 may take (default 100)")
    p.add_argument("--growth", type=float, default=1.5, help="TTFT p99 growth allowed, last third over second")
    p.add_argument("--stuck-s", type=float, default=120.0, help="longest a request may take (default 120)")
    p.add_argument("--drain-s", type=float, default=10.0)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("overload.json"))
    a = p.parse_args(argv)
    if (a.url is None) == (a.serve_args is None):
        p.error("give one of --url and --serve-args")
    return run_checked(a, run, check, summary)


if __name__ == "__main__":
    sys.exit(main())
