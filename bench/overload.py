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
The load comes from --procs client processes, each sending raw HTTP/1.1 on a connection per request (an
HTTP library's pool, or one process, delays the answers it times under hundreds of streams); the server's
/metrics event-loop lag over the run is reported beside the clients' own.
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
import multiprocessing
import random
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from soak import IDLE, gauges, pct, run_checked  # noqa: E402  (bench/ is on the path)


class Outcomes:
    def __init__(self):
        self.done, self.refused, self.errors = [], [], []  # (sent s, TTFT or answer ms) / (sent, ms) / text

    def merge(self, other: dict) -> None:
        for k in ("done", "refused", "errors"):
            getattr(self, k).extend(other[k])

    async def send(self, host: str, port: int, req: bytes, t_run: float) -> None:
        """One request on a connection of its own, in raw HTTP/1.1: what is timed is the server's answer,
        not an HTTP library's pool (httpx under a few hundred streams delayed answers by 100s of ms)."""
        t0 = time.perf_counter()
        sent, w = t0 - t_run, None
        try:
            r, w = await asyncio.open_connection(host, port)
            w.write(req)
            status_line = await r.readline()
            t_head = time.perf_counter()
            if not status_line:
                raise ValueError("the connection closed before a status line")
            status, headers = int(status_line.split()[1]), {}
            while (line := await r.readline()) not in (b"\r\n", b""):
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            if status != 200:
                body = await (r.readexactly(int(headers["content-length"])) if "content-length" in headers else r.read())
                if status != 503:
                    raise ValueError(f"{status} {body[:200]!r}")
                err, ra = json.loads(body).get("error") or {}, headers.get("retry-after", "")
                if err.get("code") != "queue_full" or not ra.isdigit() or int(ra) < 1:
                    raise ValueError(f"503 {err.get('code')} Retry-After {ra!r}")
                self.refused.append((sent, (t_head - t0) * 1e3))
                return
            if headers.get("transfer-encoding") != "chunked":
                raise ValueError(f"a stream that is not chunked: {headers}")
            t_first, tail = None, b""  # the events by substring (an event may span chunks: `tail` joins them)
            while True:
                size = int((await r.readline()).split(b";")[0], 16)
                if size == 0:
                    raise ValueError("the stream ended without [DONE]")
                data = tail + (await r.readexactly(size + 2))[:-2]
                if b'data: {"error"' in data:  # an error event (not a token whose text is "error")
                    raise ValueError(f"error event {data[-300:]!r}")
                if t_first is None and FIRST_TEXT.search(data):
                    t_first = time.perf_counter()
                if b"data: [DONE]" in data:
                    break
                tail = data[-64:]
            self.done.append((sent, ((t_first or time.perf_counter()) - t0) * 1e3))
        except Exception as e:
            self.errors.append(f"at {sent:.2f} s: {type(e).__name__}: {e}"[:300])
        finally:
            if w is not None:
                w.close()


FIRST_TEXT = re.compile(rb'"text": ?"(?!")')  # a completion chunk with text in it


def body_of(rng: random.Random, a) -> bytes:
    return json.dumps({"prompt": [rng.randrange(1000, 100_000) for _ in range(a.prompt_len)],
                       "max_tokens": a.output_len, "ignore_eos": True, "stream": True, "temperature": 0}).encode()


def request_of(host: str, body: bytes) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


async def loop_lag(samples: list, stop: asyncio.Event, period: float = 0.01) -> None:
    """How late this client's event loop wakes (ms): a late loop delays the answers it times."""
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        samples.append((time.perf_counter() - t - period) * 1e3)


def _worker(phase: str, a, host: str, port: int, index: int, t_start: float) -> dict:
    """One client process's share, from t_start (time.perf_counter(): one monotonic clock for all):
    `closed` runs a.concurrency / a.procs back-to-back clients for a.measure_s; `open` sends Poisson
    arrivals at rate a.rate / a.procs for a.seconds (the union of independent Poisson streams is one)."""
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(_worker_async(phase, a, host, port, index, t_start))


async def _worker_async(phase: str, a, host: str, port: int, index: int, t_start: float) -> dict:
    rng, out, lag, stop = random.Random(a.seed * 1000 + index + (1 if phase == "closed" else 500)), Outcomes(), [], asyncio.Event()
    if phase == "closed":
        n = a.concurrency // a.procs + (index < a.concurrency % a.procs)
        await asyncio.sleep(max(0.0, t_start - time.perf_counter()))
        end = t_start + a.measure_s

        async def client():
            while time.perf_counter() < end:  # a fresh prompt each time: no prefix-cache hits
                await out.send(host, port, request_of(host, body_of(rng, a)), t_start)
        await asyncio.gather(*(client() for _ in range(n)))
        # the last requests end after `end`: the rate is over the time they all took
        return {"done": out.done, "refused": out.refused, "errors": out.errors, "lag": lag, "stuck": 0,
                "elapsed": time.perf_counter() - t_start}
    gaps, t = [], 0.0
    while (t := t + rng.expovariate(a.rate / a.procs)) < a.seconds:
        gaps.append(t)
    reqs = [request_of(host, body_of(rng, a)) for _ in gaps]  # encoded beforehand
    tasks = set()
    await asyncio.sleep(max(0.0, t_start - time.perf_counter()))
    lag_task = asyncio.create_task(loop_lag(lag, stop))
    for t_at, req in zip(gaps, reqs):
        await asyncio.sleep(max(0.0, t_start + t_at - time.perf_counter()))
        task = asyncio.create_task(out.send(host, port, req, t_start))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    stuck = len((await asyncio.wait(tasks, timeout=a.stuck_s))[1]) if tasks else 0
    stop.set()
    await lag_task
    return {"done": out.done, "refused": out.refused, "errors": out.errors, "lag": lag, "stuck": stuck}


async def _phase(pool, phase: str, a, host: str, port: int) -> list[dict]:
    loop, t_start = asyncio.get_running_loop(), time.perf_counter() + 2.0  # the processes are up by then
    return await asyncio.gather(*(loop.run_in_executor(pool, _worker, phase, a, host, port, i, t_start)
                                  for i in range(a.procs)))


def _lag_buckets(text: str, name: str = "openinfer_event_loop_lag_seconds") -> dict:
    """A histogram's cumulative bucket counts from /metrics, by bound (s), summed over its labels."""
    out: dict = {"inf": 0.0}
    for le, v in re.findall(rf'^{name}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}} (\S+)$', text, re.M):
        k = "inf" if le == "+Inf" else float(le)
        out[k] = out.get(k, 0.0) + float(v)
    return out


async def run(a, url: str, pid: int | None = None) -> dict:
    import httpx

    u = urlsplit(url)
    host, port = u.hostname, u.port or 80
    with ProcessPoolExecutor(a.procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        async with httpx.AsyncClient(base_url=url, timeout=10, trust_env=False) as client:
            if a.saturation:
                sat = a.saturation
            else:
                parts = await _phase(pool, "closed", a, host, port)
                sat_out = Outcomes()
                for part in parts:
                    sat_out.merge(part)
                if sat_out.errors or sat_out.refused:
                    raise SystemExit(f"overload: the saturation run was refused or failed: "
                                     f"{(sat_out.errors + sat_out.refused)[:3]}")
                sat = len(sat_out.done) / max(part["elapsed"] for part in parts)
            a.rate = a.factor * sat
            m0 = (await client.get("/metrics")).text
            parts = await _phase(pool, "open", a, host, port)
            m1 = (await client.get("/metrics")).text
            lag0, lag1 = _lag_buckets(m0), _lag_buckets(m1)
            gc0, gc1 = _lag_buckets(m0, "openinfer_gc_pause_seconds"), _lag_buckets(m1, "openinfer_gc_pause_seconds")
            out, lag, stuck = Outcomes(), [], 0
            for part in parts:
                out.merge(part)
                lag += part["lag"]
                stuck += part["stuck"]
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
    diff = lambda h1, h0: {f"le_{k * 1e3:g}ms" if k != "inf" else "all": h1.get(k, 0) - h0.get(k, 0) for k in h1}  # noqa: E731
    server_lag, gc_pauses = diff(lag1, lag0), diff(gc1, gc0)
    return {"config": {"url": url, "serve_args": a.serve_args, "factor": a.factor, "seconds": a.seconds,
                       "prompt_len": a.prompt_len, "output_len": a.output_len, "concurrency": a.concurrency,
                       "measure_s": a.measure_s, "seed": a.seed, "refuse_ms": a.refuse_ms, "growth": a.growth,
                       "procs": a.procs, "date": time.strftime("%Y-%m-%d %H:%M:%S")},
            "saturation_rps": sat, "saturation_measured": a.saturation is None, "offered_rps": a.rate,
            "requests": n, "done": len(out.done), "refused": len(out.refused), "errors_total": len(out.errors),
            "errors": out.errors[:50], "stuck": stuck, "final": final,
            "done_rps": len(out.done) / a.seconds,
            "ttft_ms": {"p50": pct([m for _, m in out.done], 0.5), "p99": pct([m for _, m in out.done], 0.99),
                        "p99_second_third": pct(ttft(third, 2 * third), 0.99),
                        "p99_last_third": pct(ttft(2 * third, a.seconds), 0.99)},
            "client_loop_lag_ms": {"p50": pct(lag, 0.5), "p99": pct(lag, 0.99), "max": max(lag, default=None)},
            # the server's own event loop (/metrics' histogram over the overload): wake-ups late by at most ...
            "server_loop_lag_counts": server_lag,
            "server_gc_pause_counts": gc_pauses,  # the server's garbage collections over the overload, by length
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
             f"{f(r['max'])} ms",
             f"  client loops ({doc['config'].get('procs', 1)} processes) late by p99 "
             f"{f(doc.get('client_loop_lag_ms', {}).get('p99'))} ms; the server's loop {_late(doc)}"]
    return "\n".join(lines + ([f"FAIL: {w}" for w in doc["failures"]] or ["PASS"]))


def _late(doc: dict) -> str:
    c = doc.get("server_loop_lag_counts") or {}
    if not c.get("all"):
        return "not sampled"
    over = lambda c, ms: c["all"] - c.get(f"le_{ms}ms", c["all"])  # noqa: E731
    g = doc.get("server_gc_pause_counts") or {"all": 0}
    return (f"late by > 10 / 50 / 100 ms in {over(c, 10):.0f} / {over(c, 50):.0f} / {over(c, 100):.0f} "
            f"of {c['all']:.0f} wake-ups; its garbage collections > 10 / 50 ms: {over(g, 10):.0f} / "
            f"{over(g, 50):.0f} of {g['all']:.0f}")


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
    p.add_argument("--procs", type=int, default=4, help="client processes sharing the load (default 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("overload.json"))
    a = p.parse_args(argv)
    if (a.url is None) == (a.serve_args is None):
        p.error("give one of --url and --serve-args")
    return run_checked(a, run, check, summary)


if __name__ == "__main__":
    sys.exit(main())
