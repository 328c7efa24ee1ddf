#!/usr/bin/env python3
"""Soak test: minutes of mixed traffic against one openinfer server, failing on what only a long run
shows: unexpected errors, memory growth, stuck requests, KV blocks that do not come back.

    # start the server itself (python -m openinfer.cli SERVE_ARGS --port <free>), stop it after:
    python3 bench/soak.py --serve-args "--model-path models/qwen3-4b-random" --minutes 8 --rate 32 --out soak.json
    # or against a running server (RSS from --pid; without one RSS is not checked):
    python3 bench/soak.py --url http://127.0.0.1:8000 --pid 12345 --minutes 30 --rate 32 --out soak.json
    python3 bench/soak_plot.py soak.json soak.svg

--rate is meant to be about 80% of the saturation rate of this mix (measured with bench/serve_bench.py
or the sweep): batches stay full, but the queue does not grow without bound, so TTFT stays meaningful
and a 503 is a bug rather than overload.

Traffic: Poisson arrivals at --rate, each request drawn from MIX (after one of each kind): /v1/completions and
/v1/chat/completions, streamed and not; chats with tools (auto, required, named, none; half with a
tool round trip in the history); streams the client drops after ABORT_AFTER chunks; long prompts
(LONG of max_model_len); and prompts or max_tokens over max_model_len, which must get 400
context_length_exceeded. Prompts are random token ids (chat: random words), so the prefix cache
rarely hits; every request has ignore_eos.

Every --sample-s it records the server's RSS (VmRSS of /proc/PID/status), /metrics' KV blocks used /
promised / free and requests running / waiting, requests in flight and the oldest one's age, and the
window's client-side TTFT and TPOT p50 / p99 (streamed requests), requests done and errors.

It fails (exit 1, reasons printed) on: an unexpected answer (a 5xx or any status but the one expected,
a transport error other than its own aborts, an SSE error event, a stream without [DONE]); RSS after
the warm-up (--warmup-s, default the first 20% of the run) more than 5% over the warm-up's peak; a
request in flight longer than --stuck-s; KV blocks, running or waiting not back to 0 after the traffic
stops and --drain-s passes; a server it started that does not exit 0 on SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shlex
import signal
import socket
import string
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

MIX = {"completion": 20, "completion_stream": 20, "chat": 14, "chat_stream": 14, "tools": 12, "abort": 10,
       "long": 3, "refuse": 5}  # weights
ABORT_AFTER = 3  # chunks an aborting client reads before it disconnects
LONG = (0.5, 0.75)  # a long prompt's share of max_model_len
RSS_GROWTH = 0.05  # the most RSS may grow after the warm-up
IDLE = ("kv_blocks_used", "kv_blocks_promised", "num_requests_running", "num_requests_waiting")
GAUGES = IDLE + ("kv_blocks_free",)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_ROUND = [{"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
    "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "{\"temp\": 21}"}]


class Unexpected(Exception):
    """An answer the soak did not expect."""


def request(kind: str, rng: random.Random, max_len: int, a) -> tuple[str, dict, bool]:
    """(path, body, expect a refusal) for one request of `kind`."""
    def ids(n):
        return [rng.randrange(1000, 100_000) for _ in range(n)]  # plain-text ids of any Qwen3 vocabulary

    def words(n):
        return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(n))

    n, out = rng.randint(max(1, a.prompt_len // 8), a.prompt_len), rng.randint(8, a.output_len)
    stream = kind.endswith("_stream") or kind in ("abort", "long") or (kind == "tools" and rng.random() < 0.5)
    body = {"max_tokens": out, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "refuse":  # a prompt that alone fills max_model_len, or a max_tokens that cannot fit
        n, out = (8, max_len) if rng.random() < 0.5 else (max_len, 8)
        return "/v1/completions", dict(body, prompt=ids(n), max_tokens=out), True
    if kind == "long":
        return "/v1/completions", dict(body, prompt=ids(int(max_len * rng.uniform(*LONG))), max_tokens=16), False
    if kind.startswith("completion") or (kind == "abort" and rng.random() < 0.5):
        return "/v1/completions", dict(body, prompt=ids(n)), False
    messages = [{"role": "user", "content": words(n // 2)}]
    if kind == "tools":
        if rng.random() < 0.5:
            messages += TOOL_ROUND
        body.update(tools=TOOLS, tool_choice=rng.choice(
            ["auto", "required", "none", {"type": "function", "function": {"name": "get_weather"}}]))
    return "/v1/chat/completions", dict(body, messages=messages), False


def has_tokens(ev: dict) -> bool:
    c = ev.get("choices") or [{}]
    return bool(c[0].get("text") or any((c[0].get("delta") or {}).get(k)
                                         for k in ("content", "reasoning_content", "tool_calls")))


def pct(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]), None for no data."""
    return sorted(xs)[max(0, math.ceil(q * len(xs)) - 1)] if xs else None


class Traffic:
    """Requests in flight and what the ones that ended measured, per sample window and in all."""

    def __init__(self, t0: float):
        self.t0, self.inflight, self.counts = t0, {}, Counter()
        self.errors: list[dict] = []
        self.ttft, self.tpot = [], []  # the whole run's, ms
        self.window = self._new_window()

    @staticmethod
    def _new_window():
        return {"done": 0, "errors": 0, "aborted": 0, "refused": 0, "ttft": [], "tpot": []}

    def error(self, kind: str, what: str) -> None:
        self.window["errors"] += 1
        self.errors.append({"t": round(time.perf_counter() - self.t0, 2), "kind": kind, "what": what[:300]})

    def take_window(self) -> dict:
        w, self.window = self.window, self._new_window()
        out = {k: w[k] for k in ("done", "errors", "aborted", "refused")}
        for m in ("ttft", "tpot"):
            out[f"{m}_p50_ms"], out[f"{m}_p99_ms"] = pct(w[m], 0.5), pct(w[m], 0.99)
        return out

    async def send(self, client, kind: str, path: str, body: dict, refusal: bool) -> None:
        key, t0 = object(), time.perf_counter()
        self.inflight[key] = t0
        self.counts[kind] += 1
        try:
            if body["stream"]:
                await self._stream(client, kind, path, body, t0)
            else:
                r = await client.post(path, json=body)
                if refusal:
                    code = (r.json().get("error") or {}).get("code") if r.status_code == 400 else None
                    if code != "context_length_exceeded":
                        raise Unexpected(f"refusal answered {r.status_code} {r.text[:200]}")
                    self.window["refused"] += 1
                elif r.status_code != 200 or not r.json().get("choices"):
                    raise Unexpected(f"{r.status_code} {r.text[:200]}")
            self.window["done"] += 1
        except (Unexpected, ValueError) as e:  # ValueError: a body that is not JSON
            self.error(kind, f"{path}: {e}")
        except Exception as e:  # httpx's transport errors and timeouts above all
            self.error(kind, f"{path}: {type(e).__name__}: {e}")
        finally:
            del self.inflight[key]

    async def _stream(self, client, kind: str, path: str, body: dict, t0: float) -> None:
        t_first = t_last = usage = None
        chunks = 0
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                raise Unexpected(f"{r.status_code} {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise Unexpected(f"error event {ev['error']}")
                if has_tokens(ev):
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                usage = ev.get("usage") or usage
                chunks += 1
                if kind == "abort" and chunks >= ABORT_AFTER:
                    self.window["aborted"] += 1
                    return  # leaving the block closes the connection mid-stream
            else:
                raise Unexpected(f"the stream ended without [DONE] after {chunks} chunks")
        if t_first is not None:
            w = self.window
            w["ttft"].append((t_first - t0) * 1e3)
            self.ttft.append(w["ttft"][-1])
            if usage and usage["completion_tokens"] > 1:
                w["tpot"].append((t_last - t_first) * 1e3 / (usage["completion_tokens"] - 1))
                self.tpot.append(w["tpot"][-1])


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        m = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    except OSError:  # the process is gone
        return None
    return round(int(m.group(1)) / 1024, 1) if m else None


async def gauges(client) -> dict:
    """GAUGES from /metrics (openinfer_kv_blocks_used{model_name="..."} 3.0 -> kv_blocks_used: 3)."""
    text = (await client.get("/metrics")).text
    found = dict(re.findall(r"^openinfer_(\w+)\{[^}]*\} (\S+)$", text, re.M))
    return {k: float(found[k]) if k in found else None for k in GAUGES}


async def run_traffic(a, url: str, pid: int | None) -> dict:
    import httpx

    timeout = httpx.Timeout(2 * a.stuck_s, connect=10)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, trust_env=False,
                                 limits=httpx.Limits(max_connections=2048, max_keepalive_connections=256)) as client:
        max_len = (await client.get("/v1/models")).json()["data"][0]["max_model_len"]
        t0 = time.perf_counter()
        tr, samples, rng = Traffic(t0), [], random.Random(a.seed)

        async def sample() -> dict:
            try:
                g = await gauges(client)
            except httpx.HTTPError as e:
                tr.error("metrics", f"/metrics: {type(e).__name__}: {e}")
                g = dict.fromkeys(GAUGES)
            now = time.perf_counter()
            return {"t": round(now - t0, 2), "rss_mib": rss_mib(pid), **g, "in_flight": len(tr.inflight),
                    "oldest_s": round(max((now - t for t in tr.inflight.values()), default=0.0), 2),
                    **tr.take_window()}

        async def sampler():
            while True:
                await asyncio.sleep(a.sample_s)
                samples.append(await sample())

        sampling, tasks = asyncio.create_task(sampler()), set()
        kinds, weights = list(MIX), list(MIX.values())
        t_next, end, n = t0, t0 + a.minutes * 60, 0
        while (t_next := t_next + rng.expovariate(a.rate)) < end:
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
            kind = kinds[n] if n < len(kinds) else rng.choices(kinds, weights)[0]  # each kind once first
            n += 1
            task = asyncio.create_task(tr.send(client, kind, *request(kind, rng, max_len, a)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        # traffic stops; what is still in flight after --stuck-s more is stuck
        stuck = len((await asyncio.wait(tasks, timeout=a.stuck_s))[1]) if tasks else 0
        for t in list(tasks):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        deadline = time.perf_counter() + a.drain_s
        while True:  # the drain: until idle, or --drain-s
            try:
                final = await gauges(client)
            except httpx.HTTPError:
                final = dict.fromkeys(GAUGES)
            if all(final[k] == 0 for k in IDLE) or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.25)
        sampling.cancel()
        samples.append(await sample())
        dur = time.perf_counter() - t0
    return {"config": {"url": url, "pid": pid, "minutes": a.minutes, "rate": a.rate, "seed": a.seed,
                       "prompt_len": a.prompt_len, "output_len": a.output_len, "max_model_len": max_len,
                       "warmup_s": a.minutes * 60 * 0.2 if a.warmup_s is None else a.warmup_s,
                       "stuck_s": a.stuck_s, "drain_s": a.drain_s, "sample_s": a.sample_s,
                       "serve_args": a.serve_args, "mix": MIX},
            "duration_s": round(dur, 1), "counts": dict(tr.counts), "samples": samples,
            "errors_total": len(tr.errors), "errors": tr.errors[:100],
            "final": {**final, "stuck": stuck},
            "ttft_ms": {"p50": pct(tr.ttft, 0.5), "p99": pct(tr.ttft, 0.99)},
            "tpot_ms": {"p50": pct(tr.tpot, 0.5), "p99": pct(tr.tpot, 0.99)}}


def check(doc: dict, rss_growth: float = RSS_GROWTH) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    c, s, why = doc["config"], doc["samples"], []
    if doc["errors_total"]:
        e = doc["errors"][0]
        why.append(f"{doc['errors_total']} unexpected errors; the first, at {e['t']} s ({e['kind']}): {e['what']}")
    warm = [x["rss_mib"] for x in s if x.get("rss_mib") is not None and x["t"] <= c["warmup_s"]]
    after = [x["rss_mib"] for x in s if x.get("rss_mib") is not None and x["t"] > c["warmup_s"]]
    if warm and after and max(after) > max(warm) * (1 + rss_growth):
        why.append(f"RSS grew {max(after) / max(warm) - 1:.1%} after the warm-up ({max(warm):.0f} -> "
                   f"{max(after):.0f} MiB; the bound is {rss_growth:.0%})")
    oldest = max((x["oldest_s"] for x in s), default=0.0)
    if oldest > c["stuck_s"] or doc["final"]["stuck"]:
        why.append(f"stuck requests: the oldest in flight {oldest:.0f} s (bound {c['stuck_s']:g} s), "
                   f"{doc['final']['stuck']} still in flight {c['stuck_s']:g} s after the traffic stopped")
    busy = {k: doc["final"].get(k) for k in IDLE if doc["final"].get(k) != 0}
    if busy:
        why.append(f"not idle after the drain (--drain-s {c['drain_s']:g}): {busy}")
    if doc.get("server_exit") not in (None, 0):
        why.append(f"the server exited with status {doc['server_exit']} on SIGTERM")
    return why


def start_server(serve_args: str, log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """openinfer-serve with these arguments on a free port (unless they name one), once /health answers
    (bench/path_bench.py starts its server here too)."""
    import httpx

    argv = shlex.split(serve_args)
    if "--port" not in argv:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            argv += ["--port", str(s.getsockname()[1])]
    url = f"http://127.0.0.1:{argv[argv.index('--port') + 1]}"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "openinfer.cli", *argv], stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    proc.wait()
    sys.exit(f"{Path(sys.argv[0]).name}: the server did not become healthy (see {log}):\n"
             + "".join(log.open().readlines()[-20:]))


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, and a kill after a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def summary(doc: dict) -> str:
    c, s = doc["config"], doc["samples"]
    rss = [x["rss_mib"] for x in s if x.get("rss_mib") is not None]
    rss = f"{rss[0]:.0f} MiB first, {max(rss):.0f} max, {rss[-1]:.0f} last" if rss else "not sampled"
    ms = lambda d: "-" if d["p50"] is None else f"{d['p50']:.0f} / {d['p99']:.0f}"  # noqa: E731
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(doc["counts"].items()))
    final = ", ".join(f"{k} {v if v is None else format(v, 'g')}" for k, v in doc["final"].items())
    lines = [f"soak: {doc['duration_s']:g} s, {sum(doc['counts'].values())} requests at {c['rate']:g} req/s offered "
             f"({kinds}), {doc['errors_total']} unexpected errors",
             f"  TTFT p50 / p99 {ms(doc['ttft_ms'])} ms, TPOT p50 / p99 {ms(doc['tpot_ms'])} ms (streamed, whole run)",
             f"  RSS {rss}; KV blocks used max {max((x['kv_blocks_used'] or 0 for x in s), default=0):.0f}",
             f"  after the drain: {final}"]
    lines += [f"FAIL: {w}" for w in doc["failures"]] or ["PASS"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one with --serve-args)")
    p.add_argument("--serve-args", help="openinfer-serve's arguments for the server this starts and stops")
    p.add_argument("--pid", type=int, help="the --url server's process id, for its RSS")
    p.add_argument("--minutes", type=float, default=5.0, help="length of the traffic (default 5)")
    p.add_argument("--rate", type=float, default=8.0, help="requests per second, Poisson (about 80%% of saturation)")
    p.add_argument("--prompt-len", type=int, default=512, help="longest ordinary prompt, tokens (shortest: 1/8 of it)")
    p.add_argument("--output-len", type=int, default=128, help="largest max_tokens of an ordinary request (least 8)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between samples (default 5)")
    p.add_argument("--warmup-s", type=float, help="seconds not held to the RSS bound (default: 20%% of the run)")
    p.add_argument("--stuck-s", type=float, default=60.0, help="longest a request may be in flight (default 60)")
    p.add_argument("--drain-s", type=float, default=10.0, help="seconds the server has to go idle after (default 10)")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds a started server has to be healthy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("soak.json"), help="the JSON time series (default soak.json)")
    a = p.parse_args(argv)
    if (a.url is None) == (a.serve_args is None):
        p.error("give one of --url and --serve-args")
    return run_checked(a, run_traffic, check, summary)


def run_checked(a, traffic, check, summary) -> int:
    """`traffic(a, url, pid)` (a coroutine making the result's dict) against --url, or a server started
    from --serve-args and stopped after (its exit status recorded); then check(doc)'s failures, the JSON
    to --out and summary(doc) printed. Exit status 0 when it passed (bench/overload.py runs here too)."""
    proc, url, pid = None, a.url, getattr(a, "pid", None)
    if a.serve_args is not None:
        proc, url = start_server(a.serve_args, a.out.with_suffix(".server.log"), a.start_timeout)
        pid = proc.pid
    try:
        doc = asyncio.run(traffic(a, url.rstrip("/"), pid))
    finally:
        if proc is not None:
            stop_server(proc)
    if proc is not None:
        doc["server_exit"] = proc.returncode
    doc["failures"] = check(doc)
    doc["passed"] = not doc["failures"]
    a.out.write_text(json.dumps(doc, indent=1))
    print(summary(doc))
    return 0 if doc["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
