"""Prometheus metrics. One registry per app, so several servers in one process do not collide.

Engine-side numbers (queues, KV blocks, token counters) are read from the engine loop's latest
`stats()` snapshot at scrape time; latency histograms are observed on the asyncio side as updates
arrive.
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import logging
import time
from collections import deque

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.utils import floatToGoString

log = logging.getLogger("openinfer.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

def stat(stats: dict, key: str, default: float = 0) -> float:
    v = stats.get(key)
    return default if v is None else v


class _EngineCollector:
    def __init__(self, async_engine, model_name: str):
        self.ae, self.model = async_engine, model_name

    def collect(self):
        s, lab = self.ae.stats, [self.model]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(lab, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(lab, float(value))
            return c

        hit, query = stat(s, "prefix_cache_hit_tokens"), stat(s, "prefix_cache_queried_tokens")
        yield gauge("openinfer_engine_alive", "1 while the engine loop thread runs", self.ae.alive)
        yield gauge("openinfer_num_requests_running", "Requests in the decode batch", stat(s, "num_running"))
        yield gauge("openinfer_num_requests_waiting", "Requests waiting for admission", stat(s, "num_waiting"))
        yield gauge("openinfer_kv_blocks_used", "KV-cache blocks held by requests", stat(s, "kv_blocks_used"))
        yield gauge("openinfer_kv_blocks_free", "KV-cache blocks free (cached-free included)",
                    stat(s, "kv_blocks_free"))
        yield gauge("openinfer_kv_blocks_cached", "Free KV blocks still holding a cached prefix",
                    stat(s, "kv_blocks_cached"))
        yield gauge("openinfer_kv_blocks_promised", "KV blocks reserved for admitted requests, "
                    "not yet allocated", stat(s, "kv_blocks_promised"))
        yield gauge("openinfer_prefix_cache_hit_rate", "Prefix-cache hit tokens / query tokens",
                    hit / query if query else 0.0)
        yield counter("openinfer_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", hit)
        yield counter("openinfer_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                      query)
        yield counter("openinfer_prompt_tokens", "Prompt tokens processed", stat(s, "prompt_tokens"))
        yield counter("openinfer_generation_tokens", "Tokens generated", stat(s, "generation_tokens"))
        yield counter("openinfer_engine_steps", "Engine steps run", self.ae.step_count)
        yield counter("openinfer_overlapped_steps", "Steps launched before the previous step's tokens "
                      "reached the host", stat(s, "overlapped_steps"))
        yield counter("openinfer_step_wall_seconds", "Wall time inside engine steps", stat(s, "step_wall_seconds"))
        yield counter("openinfer_step_gpu_seconds", "GPU time of engine steps (CUDA events)",
                      stat(s, "step_gpu_seconds"))
        yield counter("openinfer_engine_busy_seconds", "Wall time of engine-loop iterations that ran a step "
                      "(step + scheduling + handing updates to HTTP); GPU share = step_gpu / this",
                      self.ae.busy_seconds)
        yield gauge("openinfer_last_step_host_ms", "Wall minus GPU time of the last step: host time the GPU waited on "
                    "(about 0 when decode steps overlap)",
                    stat(s, "last_step_host_ms"))
        yield gauge("openinfer_last_step_gpu_ms", "GPU time of the last step", stat(s, "last_step_gpu_ms"))
        # the host KV tier (all 0 without --kv-offload)
        total, used = stat(s, "host_tier_blocks_total"), stat(s, "host_tier_blocks_used")
        yield gauge("openinfer_host_kv_blocks_used", "Host KV tier slots holding a block", used)
        yield gauge("openinfer_host_kv_blocks_free", "Host KV tier slots never used yet", total - used)
        yield counter("openinfer_host_restored_tokens", "Prompt tokens restored from the host KV tier (GPU prefix "
                      "hits: openinfer_prefix_cache_hit_tokens)", stat(s, "host_hit_tokens"))
        yield counter("openinfer_host_offloaded_blocks", "KV blocks whose copy to the host tier was issued",
                      stat(s, "offloaded_blocks"))
        yield counter("openinfer_host_restored_blocks", "KV blocks restored from the host tier", stat(s, "restored_blocks"))
        yield counter("openinfer_host_evicted_blocks", "Host tier blocks evicted (LRU) for newer ones",
                      stat(s, "host_tier_evictions"))
        yield counter("openinfer_host_offloaded_bytes", "Bytes copied device to host (landed)", stat(s, "offloaded_bytes"))
        yield counter("openinfer_host_restored_bytes", "Bytes copied host to device (landed)", stat(s, "restored_bytes"))
        yield counter("openinfer_host_restore_seconds", "Device time of the landed restore copies (bandwidth: "
                      "restored_bytes / this)", stat(s, "restore_seconds"))
        # speculative decoding (all 0 without a drafter)
        rounds, acc = stat(s, "spec_rounds"), stat(s, "spec_accepted_tokens")
        yield counter("openinfer_spec_rounds", "Verify steps of speculating requests (rounds)", rounds)
        yield counter("openinfer_spec_draft_tokens", "Draft tokens proposed", stat(s, "spec_draft_tokens"))
        yield counter("openinfer_spec_accepted_tokens", "Draft tokens accepted (the bonus token not counted)", acc)
        yield gauge("openinfer_spec_mean_acceptance_length", "Tokens kept per round, the bonus included "
                    "((accepted + rounds) / rounds)", (acc + rounds) / rounds if rounds else 0.0)
        yield counter("openinfer_spec_draft_seconds", "Time spent drafting", stat(s, "spec_draft_seconds"))
        yield counter("openinfer_spec_verify_seconds", "Wall time of verify steps (drafting inside them included)",
                      stat(s, "spec_verify_seconds"))


# A request's path to its first token, as PathTrace stamps it: (phase, the boundary that ends it), in the
# order they happen; the first phase starts at `arrival`. Where each boundary is stamped, and why there,
# is said at the stamp (server/routes.py, server/async_engine.py, engine.py, runner.py, scheduler.py).
PATH = (
    ("route", "handler"),          # the app's ASGI call -> the handler: Starlette's routing, the Request, auth
    ("body", "body"),              # -> the whole body read
    ("parse", "parsed"),           # -> JSON parsed and validated (protocol.parse_*)
    ("template", "templated"),     # -> chat template rendered (chat only)
    ("tokenize", "tokenized"),     # -> the prompt's token ids, length checks included
    ("submit", "queued"),          # -> the first engine request goes on the engine thread's inbox
    ("inbox", "accepted"),         # -> the engine thread has taken it (add_request done)
    ("admit", "admitted"),         # -> schedule() admitted it into a step
    ("launch", "launched"),        # -> the backend call of the step that samples its first token
    ("step", "collected"),         # -> that step's output is on the host
    ("postprocess", "processed"),  # -> the step's updates are made (token appended, stop checks, detokenized)
    ("handover", "posted"),        # -> they are posted to the event loop
    ("wakeup", "delivered"),       # -> the handler has the request's first update
    ("decode", "last"),            # non-streamed only: -> its last update (the rest of the tokens)
    ("respond", "sent"),           # -> the bytes carrying the first token go to uvicorn (SSE chunk; else the body)
)
PATH_PHASES = tuple(p for p, _ in PATH)
ARRIVAL = "openinfer.arrival_ns"  # the ASGI scope's key for the arrival stamp (app.py)
_BOUNDARIES = tuple(b for _, b in PATH)
_OPTIONAL = frozenset({"templated", "last"})  # 0 when the request has no such phase (completions; streams)
# 1, 2, 3, 5, 7 per decade from 1 us to 100 ms, where the path's phases fall (interpolated quantiles
# within about 20%), then coarser to 60 s for queueing, long prefills and non-streamed decodes; in ns,
# so that observe() bisects ints.
PATH_BUCKETS_NS = (tuple(int(float(f"{m}e{e}")) for e in range(3, 8) for m in (1, 2, 3, 5, 7))
                   + tuple(int(x * 1e9) for x in (0.2, 0.5, 1, 2, 5, 10, 30, 60)))
_PATH_METRIC = "openinfer_request_path_seconds"
_PATH_HELP = ("A request's time by phase of its path to the first token's bytes (docs/serving.md: Where a "
              "request's time goes)")


class PathTrace:
    """perf_counter_ns at each boundary of PATH for one HTTP request (0: not reached). The event loop
    stamps its own; the engine thread writes the engine's (accepted .. posted) once, before it posts
    the request's first update, so the event loop reads them after (the GIL orders the writes)."""
    __slots__ = ("endpoint", "stream", "arrival") + _BOUNDARIES

    def __init__(self, endpoint: str, arrival: int):
        self.endpoint, self.stream, self.arrival = endpoint, False, arrival
        for b in _BOUNDARIES:
            setattr(self, b, 0)

    def got(self, t: int) -> None:
        """An update reached the handler at t."""
        if not self.delivered:
            self.delivered = t
        if not self.stream:  # a body waits for the last
            self.last = t

    def sending(self) -> None:
        """Bytes go to the HTTP server now; the first time after the first update, the first token's.
        Stamped before the hand-over, not after the write: the client may read the bytes before the
        event loop is back from writing them (the GIL), and a stamp after what the client saw would
        not be on the request's path. uvicorn's framing and write count with its request parsing,
        outside the trace."""
        if self.delivered and not self.sent:
            self.sent = time.perf_counter_ns()

    def phases(self) -> list[int | None] | None:
        """Each PATH phase's ns (None: a phase this request does not have), or None when a boundary is
        missing (the request failed or was cut short, or an engine keeps no step times)."""
        out, prev = [], self.arrival
        for b in _BOUNDARIES:
            t = getattr(self, b)
            if not t:
                if b not in _OPTIONAL:
                    return None
                out.append(None)
                continue
            out.append(t - prev)
            prev = t
        return out


class PathHistogram:
    """openinfer_request_path_seconds{phase, endpoint, stream}: PathTrace's phases, one observation per
    served request. Its own buckets and text, not prometheus_client's: observe() and render() both run on
    the event loop, so plain lists need no lock (a request's 14 observations cost ~5 us, not ~30), and
    the ~2000 lines render in about a millisecond, not 25 (generate_latest)."""

    def __init__(self):
        self._kinds: dict[tuple[str, bool], list[list[int]]] = {}  # per phase: bucket counts, then the sum (ns)

    def observe(self, trace: PathTrace) -> None:
        durs = trace.phases()
        if durs is None:
            return
        kind = (trace.endpoint, trace.stream)
        rows = self._kinds.get(kind)
        if rows is None:
            rows = self._kinds[kind] = [[0] * (len(PATH_BUCKETS_NS) + 2) for _ in PATH]
        for c, ns in zip(rows, durs):
            if ns is not None:
                c[bisect.bisect_left(PATH_BUCKETS_NS, ns)] += 1
                c[-1] += ns
        if log.isEnabledFor(logging.DEBUG):
            log.debug("path %s stream=%s: %s", trace.endpoint, trace.stream,
                      " ".join(f"{p}={ns / 1e3:.1f}us" for p, ns in zip(PATH_PHASES, durs) if ns is not None))

    def render(self) -> str:
        """Prometheus text: every phase a request of each (endpoint, stream) seen so far went through."""
        les = [floatToGoString(b / 1e9) for b in PATH_BUCKETS_NS] + ["+Inf"]
        out = [f"# HELP {_PATH_METRIC} {_PATH_HELP}", f"# TYPE {_PATH_METRIC} histogram"]
        for i, phase in enumerate(PATH_PHASES):
            for (endpoint, stream), rows in sorted(self._kinds.items()):
                c = rows[i]
                acc = sum(c[:-1])
                if not acc:
                    continue
                lab = f'endpoint="{endpoint}",phase="{phase}",stream="{"true" if stream else "false"}"'
                n = 0
                for le, k in zip(les, c):
                    n += k
                    out.append(f'{_PATH_METRIC}_bucket{{{lab},le="{le}"}} {n}.0')
                out.append(f"{_PATH_METRIC}_count{{{lab}}} {acc}.0")
                out.append(f"{_PATH_METRIC}_sum{{{lab}}} {c[-1] / 1e9!r}")
        return "\n".join(out) + "\n"


LOOP_PROBE_S = 0.01


class Metrics:
    def __init__(self, async_engine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(async_engine, model_name))
        self.path = PathHistogram()
        self.ttft = Histogram(
            "openinfer_time_to_first_token_seconds", "Arrival to first generated token",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0))
        self.tpot = Histogram(
            "openinfer_time_per_output_token_seconds", "Mean inter-token time of a request after its first",
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                     0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5))
        self.e2e = Histogram("openinfer_e2e_request_latency_seconds", "Arrival to last token",
                             registry=self.registry,
                             buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320))
        # A late event loop delays every answer the server gives, a 503 and /health included.
        self.loop_lag = Histogram("openinfer_event_loop_lag_seconds",
                                  f"How late the event loop wakes from a {LOOP_PROBE_S * 1e3:g} ms sleep",
                                  registry=self.registry,
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))

        # A collection runs on whichever thread allocates and holds the GIL throughout: a long one stalls
        # the event loop and the engine thread alike.
        self.gc_pause = Histogram("openinfer_gc_pause_seconds", "Python garbage collections by length",
                                  ["generation"], registry=self.registry,
                                  buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25))
        self._gc_t0 = 0.0
        self._gc_done: deque[tuple[str, float]] = deque(maxlen=4096)
        # A request's latencies, observed once its response is out (or by the loop's watch, every
        # LOOP_PROBE_S, or a scrape, whichever comes first): a histogram's observe() costs ~25 us right
        # after a step (2-vCPU VM), on the path of the token that ends a latency, and an append ~2.
        self._later: deque[tuple[Histogram, float]] = deque()

    def _on_gc(self, phase: str, info: dict) -> None:
        # Only a deque append here: a collection can start inside any allocation, on a thread that holds
        # a metric's lock (a render), and taking that lock again from here would deadlock it.
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif self._gc_t0:
            self._gc_done.append((str(info.get("generation", "?")), time.perf_counter() - self._gc_t0))

    def flush(self) -> None:
        """Observes what waits: collections' pauses, requests' latencies."""
        while self._gc_done:
            gen, dt = self._gc_done.popleft()
            self.gc_pause.labels(gen).observe(dt)
        while self._later:
            hist, v = self._later.popleft()
            hist.observe(v)

    def observe_later(self, hist: Histogram, value: float) -> None:
        self._later.append((hist, value))

    def start(self) -> None:
        """Starts timing collections (with the app's lifespan; `close` ends it)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    async def watch_loop(self) -> None:
        """Observes the event loop's lateness until cancelled (started with the app)."""
        while True:
            t = time.perf_counter()
            await asyncio.sleep(LOOP_PROBE_S)
            self.loop_lag.observe(max(0.0, time.perf_counter() - t - LOOP_PROBE_S))
            self.flush()

    def render(self) -> bytes:
        self.flush()
        return generate_latest(self.registry) + self.path.render().encode()


class RequestTimer:
    """Per-request latency bookkeeping; TTFT at the first token, TPOT at the end (observed by the metrics'
    next flush: the response's end, the loop's watch or a scrape)."""

    def __init__(self, metrics: Metrics, t_arrival: float):
        self.m, self.t0 = metrics, t_arrival
        self.t_first: float | None = None
        self.t_last = t_arrival
        self.tokens = 0

    def tokens_arrived(self, n: int, t: float) -> None:
        if n <= 0:
            return
        if self.t_first is None:
            self.t_first = t
            self.m.observe_later(self.m.ttft, t - self.t0)
        self.tokens += n
        self.t_last = t

    def finish(self) -> None:
        if self.t_first is not None:
            self.m.observe_later(self.m.e2e, self.t_last - self.t0)
            if self.tokens > 1:
                self.m.observe_later(self.m.tpot, (self.t_last - self.t_first) / (self.tokens - 1))
