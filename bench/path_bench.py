#!/usr/bin/env python3
"""Where a lone request's time goes around its step: sequential requests, one at a time, and the
server's path trace (/metrics `openinfer_request_path_seconds{phase, endpoint, stream}`, docs/serving.md
"Where a request's time goes") beside the client's own time to first token.

    python3 bench/path_bench.py --out path.json                   # a tiny random model on the CPU backend
    python3 bench/path_bench.py --serve-args "--model-path models/qwen3-4b-random --device cuda" --out path.json
    python3 bench/path_bench.py --url http://127.0.0.1:8000 --out path.json
    STAGES=path bash bench/gpu_session.sh                         # the 4B on the GPU

Kinds: /v1/completions and /v1/chat/completions, streamed and not, at each --max-tokens (with
--prompt-tokens N: completions alone, the prompt N token ids, the same each time: after the first, a
prefix-cache hit whose step computes one token over N of context, the warm-TTFT case; with --cold, a new
prompt each request (the cold case: its chunk's step and its last token's); with --text, a
text of about N tokens instead, tokenized by every request); each sends
--warmup requests, then --requests more between two scrapes of /metrics, whose difference gives the
kind's phases: p50 / p90 interpolated in the histogram's buckets (as Prometheus' histogram_quantile),
means exact (sum / count). The client is a raw keep-alive HTTP/1.1 socket, so its own cost in the
time to first token (TTFT: request written to the bytes of the first token read; non-streamed: the
whole body) is a few microseconds of Python.

  around the step = client TTFT - the step's own time (the trace's `step` phase: launch to collect of
                    the step that sampled the first token; non-streamed with several tokens also less
                    `decode`, the steps after it);
  unaccounted     = client TTFT - every phase: the kernel's loopback both ways, uvicorn's reading and
                    parsing of the headers before the app runs, and the client.
The engine's own wall time per request (openinfer_step_wall_seconds_total over the same requests, every
engine.step() call: the step plus its scheduling and postprocessing) is shown beside the trace's `step`
as a check.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from openinfer.server.metrics import PATH_PHASES as PHASES
from soak import start_server, stop_server  # noqa: E402  (bench/ is on the path: the script's own folder)

ENGINE = ("step", "decode")  # the engine's work: what is not the path around the step
HIST = "openinfer_request_path_seconds"
COMPLETION = {"prompt": "The capital of France is"}
WORDS = ("time year people way day man thing woman life child world school state family student group country "
         "problem hand part place case week company system program question work government number night point "
         "home water room mother area money story fact month lot right study book eye job word business issue "
         "side kind head house service friend father power hour game line end member law car city community name").split()
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}


class Client:
    """One keep-alive HTTP/1.1 connection, read by hand: the time a token's bytes arrive, not a library's
    parsing after."""

    def __init__(self, host: str, port: int):
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.host = host

    def _recv(self) -> float:
        data = self.sock.recv(1 << 16)
        t = time.perf_counter()
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data
        return t

    def post(self, path: str, body: dict, skip: int) -> tuple[float, float, list[bytes]]:
        """(TTFT s, end-to-end s, SSE events or [body]). `skip`: events before the first token's (chat's
        role chunk)."""
        raw = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(raw)}\r\n\r\n").encode()
        t0 = time.perf_counter()
        self.sock.sendall(head + raw)
        t = t0
        while b"\r\n\r\n" not in self.buf:
            t = self._recv()
        hdr, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = hdr.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n:
                t = self._recv()
            body_bytes, self.buf = self.buf[:n], self.buf[n:]
            if status != 200:
                raise RuntimeError(f"{path}: {status} {body_bytes[:300]!r}")
            return t - t0, t - t0, [body_bytes]
        if status != 200 or headers.get("transfer-encoding") != "chunked":
            raise RuntimeError(f"{path}: {status} {headers}")
        events, sse, t_first = [], b"", None
        while True:  # chunks as they complete; each event stamped with the read that completed it
            while (i := self.buf.find(b"\r\n")) >= 0:
                size = int(self.buf[:i], 16)
                if len(self.buf) < i + 4 + size:
                    break
                sse += self.buf[i + 2:i + 2 + size]
                self.buf = self.buf[i + 4 + size:]
                if size == 0:
                    if t_first is None:
                        raise RuntimeError(f"{path}: a stream of {len(events)} events and no token")
                    return t_first - t0, t - t0, events
                while b"\n\n" in sse:
                    ev, sse = sse.split(b"\n\n", 1)
                    events.append(ev)
                    if len(events) == skip + 1:
                        t_first = t
            t = self._recv()


_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the server is local: no proxy


def get(url: str):
    return _HTTP.open(url, timeout=30)


def scrape(url: str) -> str:
    with get(url + "/metrics") as r:
        return r.read().decode()


_LINE = re.compile(r'^(\w+?)(?:\{([^}]*)\})? (\S+)$', re.M)


def parse(text: str) -> dict:
    """{(name, frozenset of labels): value} of every sample."""
    out = {}
    for name, labels, v in _LINE.findall(text):
        out[(name, frozenset(re.findall(r'(\w+)="([^"]*)"', labels)))] = float(v)
    return out


def plain(s: dict, name: str) -> float:
    """A series' value, whatever its labels (the first found; 0 when absent)."""
    return next((v for (n, _), v in s.items() if n == name), 0.0)


def phase_stats(before: dict, after: dict, endpoint: str, stream: bool) -> dict:
    """{phase: {count, mean_us, p50_us, p90_us}} from the histogram's difference for this endpoint/stream."""
    want = {("endpoint", endpoint), ("stream", "true" if stream else "false")}
    out = {}
    for phase in PHASES:
        lab = frozenset(want | {("phase", phase)})
        key = lambda suffix, extra=(): (HIST + suffix, lab | frozenset(extra))  # noqa: E731
        n = after.get(key("_count"), 0) - before.get(key("_count"), 0)
        if n <= 0:
            continue
        total = after.get(key("_sum"), 0) - before.get(key("_sum"), 0)
        les = sorted({dict(ls)["le"] for (name, ls) in after if name == HIST + "_bucket" and lab <= ls},
                     key=lambda le: math.inf if le == "+Inf" else float(le))
        cum = [(math.inf if le == "+Inf" else float(le),
                after.get(key("_bucket", {("le", le)}), 0) - before.get(key("_bucket", {("le", le)}), 0)) for le in les]
        out[phase] = {"count": int(n), "mean_us": total / n * 1e6,
                      "p50_us": quantile(cum, 0.5) * 1e6, "p90_us": quantile(cum, 0.9) * 1e6}
    return out


def quantile(cum: list[tuple[float, float]], q: float) -> float:
    """Linear interpolation within the bucket, as Prometheus' histogram_quantile (cumulative buckets)."""
    rank, lo, prev = q * cum[-1][1], 0.0, 0.0
    for le, c in cum:
        if c >= rank:
            if le == math.inf:
                return lo
            return lo + (le - lo) * ((rank - prev) / (c - prev) if c > prev else 0.0)
        lo, prev = le, c
    return lo


def pcts(xs: list[float]) -> dict:
    s = sorted(xs)
    at = lambda q: s[max(0, math.ceil(q * len(s)) - 1)] * 1e6  # noqa: E731 (nearest rank)
    return {"p50_us": at(0.5), "p90_us": at(0.9), "mean_us": statistics.fmean(s) * 1e6}


FRESH = itertools.count()


def run_kind(c: Client, url: str, model: str, endpoint: str, stream: bool, max_tokens: int, a) -> dict:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    prompt = {"prompt": [(i * 7919) % 30000 + 100 for i in range(a.prompt_tokens)]} if a.prompt_tokens else None
    if a.prompt_tokens and a.text:  # common English words, one token each with their space: tokenized per request
        rng = random.Random(a.prompt_tokens)
        prompt = {"prompt": "The" + "".join(" " + rng.choice(WORDS) for _ in range(a.prompt_tokens - 1))}
    body = dict(prompt or (COMPLETION if endpoint == "completions" else CHAT), model=model, max_tokens=max_tokens,
                temperature=0, ignore_eos=True, stream=stream)
    skip = 1 if endpoint == "chat_completions" and stream else 0  # chat streams open with the role chunk
    # --cold: a first token no earlier request had (of any kind: one counter for the run), so no block is cached
    nxt = (lambda: dict(body, prompt=[150000 - next(FRESH) % 140000] + body["prompt"][1:])) if a.cold else (lambda: body)
    for _ in range(a.warmup):
        c.post(path, nxt(), skip)
    before = parse(scrape(url))
    ttft, e2e = [], []
    for _ in range(a.requests):
        t, e, _ = c.post(path, nxt(), skip)
        ttft.append(t)
        e2e.append(e)
    after = parse(scrape(url))
    ph = phase_stats(before, after, endpoint, stream)
    d = lambda name: plain(after, name) - plain(before, name)  # noqa: E731
    steps = d("openinfer_engine_steps_total")
    client = {"ttft": pcts(ttft), "e2e": pcts(e2e)}
    mean_ttft = client["ttft"]["mean_us"]
    engine = sum(ph[p]["mean_us"] for p in ENGINE if p in ph and (p != "decode" or not stream))
    traced = sum(v["mean_us"] for v in ph.values())
    return {"endpoint": endpoint, "stream": stream, "max_tokens": max_tokens, "requests": a.requests,
            "phases": ph, "client": client,
            "server_phases_sum_us": traced,
            "around_step_us": mean_ttft - engine,  # means: a difference of medians means nothing
            "around_step_traced_us": traced - engine,
            "unaccounted_us": mean_ttft - traced,
            "engine_metrics": {  # the engine's own step figures over the same requests, as a check on `step`
                "steps_per_request": steps / a.requests,  # engine.step() calls (overlapped: one more than steps)
                "step_wall_per_request_us": d("openinfer_step_wall_seconds_total") / a.requests * 1e6,
                "step_gpu_per_request_us": d("openinfer_step_gpu_seconds_total") / a.requests * 1e6,
                "server_ttft_mean_us": (d("openinfer_time_to_first_token_seconds_sum")
                                        / d("openinfer_time_to_first_token_seconds_count") * 1e6)
                if d("openinfer_time_to_first_token_seconds_count") else None}}


def table(kinds: list[dict]) -> str:
    name = lambda k: f"{'chat' if k['endpoint'] == 'chat_completions' else 'cmpl'}{'-s' if k['stream'] else ''}/{k['max_tokens']}"  # noqa: E731
    w = 13
    lines = ["per phase, us: p50 / p90 (server trace; mean in the JSON)",
             f"{'':13}" + "".join(f"{name(k):>{w}}" for k in kinds)]
    f = lambda v: "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"  # noqa: E731
    for p in PHASES:
        cells = [f"{f(k['phases'][p]['p50_us'])}/{f(k['phases'][p]['p90_us'])}" if p in k["phases"] else "-"
                 for k in kinds]
        lines.append(f"{p:13}" + "".join(f"{c:>{w}}" for c in cells))
    rows = [("phases, sum", lambda k: f(k["server_phases_sum_us"])),
            ("TTFT client", lambda k: f"{f(k['client']['ttft']['p50_us'])}/{f(k['client']['ttft']['p90_us'])}"),
            ("TTFT mean", lambda k: f(k["client"]["ttft"]["mean_us"])),
            ("around step", lambda k: f(k["around_step_us"])),
            ("unaccounted", lambda k: f(k["unaccounted_us"])),
            ("engine wall", lambda k: f(k["engine_metrics"]["step_wall_per_request_us"])),
            ("engine calls", lambda k: f"{k['engine_metrics']['steps_per_request']:.2f}")]
    lines.append("per request, us: means (engine wall: openinfer_step_wall_seconds_total, every engine.step() call)")
    for label, fn in rows:
        lines.append(f"{label:13}" + "".join(f"{fn(k):>{w}}" for k in kinds))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one with --serve-args)")
    p.add_argument("--serve-args", help="openinfer-serve's arguments for the server this starts and stops "
                   "(default: a tiny random checkpoint on the CPU backend)")
    p.add_argument("--requests", type=int, default=100, help="measured requests per kind (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="requests per kind before the measured ones (default 10)")
    p.add_argument("--max-tokens", default="1,8", help="max_tokens of the kinds, comma-separated (default 1,8)")
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="prompts of this many token ids, the same each time (completions only: warm prefix hits)")
    p.add_argument("--text", action="store_true",
                   help="with --prompt-tokens: the prompt as text of about that many tokens (the same each time), "
                        "so that its tokenization is on the path")
    p.add_argument("--cold", action="store_true",
                   help="with --prompt-tokens (ids): a new prompt each request (its first id changed), the cold-TTFT case")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, help="the JSON (default: none)")
    a = p.parse_args(argv)
    if a.url and a.serve_args:
        p.error("give at most one of --url and --serve-args")
    if a.cold and (not a.prompt_tokens or a.text):
        p.error("--cold takes --prompt-tokens N (token ids), without --text")
    proc, url, tmp = None, a.url, None
    if url is None:
        serve_args = a.serve_args
        if serve_args is None:
            tmp = tempfile.TemporaryDirectory(prefix="path_bench-")
            subprocess.run([sys.executable, "-m", "openinfer.tools.random_checkpoint", "--preset", "tiny", "--out",
                            f"{tmp.name}/tiny"], check=True, capture_output=True)
            n = max(2048, a.prompt_tokens + 64)
            serve_args = f"--model-path {tmp.name}/tiny --device cpu --max-model-len {n} --num-kv-blocks {n // 16 + 64}"
        if "--log-level" not in serve_args:  # a debug log writes every trace: not what is measured
            serve_args += " --log-level warning"
        log = (a.out or Path(tempfile.gettempdir()) / "path_bench.json").with_suffix(".server.log")
        proc, url = start_server(serve_args, log, a.start_timeout)
    url = url.rstrip("/")
    try:
        with get(url + "/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        c = Client(host.strip("[]"), int(port))
        kinds = []
        for endpoint in ("completions",) if a.prompt_tokens else ("completions", "chat_completions"):
            for stream in (False, True):
                for mt in map(int, a.max_tokens.split(",")):
                    kinds.append(run_kind(c, url, model, endpoint, stream, mt, a))
                    print(f"  {endpoint} stream={stream} max_tokens={mt}: TTFT p50 "
                          f"{kinds[-1]['client']['ttft']['p50_us']:.0f} us", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
        if tmp is not None:
            tmp.cleanup()
    doc = {"config": {"url": a.url, "serve_args": a.serve_args, "requests": a.requests, "warmup": a.warmup,
                      "max_tokens": a.max_tokens, "prompt_tokens": a.prompt_tokens, "text": a.text, "cold": a.cold, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname()},
           "kinds": kinds}
    print(table(kinds))
    if a.out:
        a.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
