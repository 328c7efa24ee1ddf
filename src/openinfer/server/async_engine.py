"""AsyncEngine: the synchronous LLMEngine step loop in its own thread, fed from asyncio.

The engine is not thread-safe, so only the loop thread touches it: requests and aborts arrive on a
thread-safe inbox, and updates go back to each request group's asyncio.Queue through one
`loop.call_soon_threadsafe` per step. The backend's step releases the GIL, so the event loop keeps
serving HTTP while a step runs; a step's updates, and the news that requests were added, are handed over
from `engine.step(before_launch=...)` of the next step, right before that step's device work.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

log = logging.getLogger("openinfer.server")


class EngineDeadError(RuntimeError):
    """The engine loop thread is gone; nothing can be served."""


class EngineStepError(RuntimeError):
    """A step raised; the requests in flight were failed and aborted, the loop lives on."""
    status, code = 500, "internal_error"  # what the client is answered


class ShuttingDown(EngineStepError):
    """The server is stopping and the request's time to finish is up (--shutdown-timeout)."""
    status, code = 503, "server_shutting_down"


class DrainRate:
    """How fast the waiting queue drains: requests admitted per second over the last WINDOW_S, from
    (time, admitted so far) samples the engine thread takes. `retry_after` tells a refused client
    when the queue ahead of it will have drained at that rate, so retries spread out with the load
    (a constant 1 s had 40 clients make 608 attempts)."""
    WINDOW_S = 10.0
    MIN_SPAN_S = 0.5  # a rate from a shorter span is noise
    MAX_S = 60  # and when nothing drains at all

    def __init__(self):
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def sample(self, t: float, admitted: int) -> None:
        with self._lock:
            self._samples.append((t, admitted))
            while len(self._samples) > 2 and self._samples[1][0] <= t - self.WINDOW_S:
                self._samples.popleft()

    def rate(self) -> float | None:
        """Requests per second, or None before MIN_SPAN_S of samples."""
        with self._lock:
            if len(self._samples) < 2:
                return None
            (t0, a0), (t1, a1) = self._samples[0], self._samples[-1]
        return (a1 - a0) / (t1 - t0) if t1 - t0 >= self.MIN_SPAN_S else None

    def retry_after(self, waiting: int) -> int:
        """Whole seconds until `waiting` requests ahead have been admitted, in [1, MAX_S]."""
        r = self.rate()
        if not r:
            return 1 if r is None or waiting == 0 else self.MAX_S
        return max(1, min(self.MAX_S, math.ceil(waiting / r)))


@dataclass
class _Sub:
    """One engine request belonging to a group (one choice of an HTTP request)."""
    group: "RequestGroup"
    index: int
    trace: Any = None  # the group's PathTrace until this request's first update is posted
    accepted: int = 0  # perf_counter_ns when the engine thread had added it
    seq: Any = None  # the scheduler's Sequence (its admission time)


class RequestGroup:
    """The engine requests of one HTTP request, all reporting into one asyncio queue."""

    def __init__(self, engine: "AsyncEngine", prefix: str, trace=None):
        self._engine = engine
        self.trace = trace  # a server.metrics.PathTrace, or None
        self._loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request_ids: list[str] = []
        self._prefix = prefix
        self._open = 0  # sub-requests not finished yet
        self._dropped: set[int] = set()  # sub-requests aborted by abort(): their updates are skipped
        self._finished: set[int] = set()

    def _post(self, item) -> None:  # called from the engine thread
        try:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # event loop closed: the server is shutting down
            pass

    async def add(self, prompts: list[list[int]], params: Any) -> None:
        """Submits one request per prompt (index = position), all before waiting, so the engine loop
        admits them in one pass (one at a time took an engine step each: a 64-prompt request under
        load queued for 64 steps). `params`: one SamplingParams for all, or a list, one per prompt.
        Raises the first admission error in prompt order (RequestRejected, QueueFull); close() then
        aborts whatever was admitted."""
        per = params if isinstance(params, list) else [params] * len(prompts)
        futs = []
        if self.trace is not None:  # before the first put: the engine thread may take it at once
            self.trace.queued = time.perf_counter_ns()
        for index, (prompt_token_ids, params) in enumerate(zip(prompts, per)):
            rid = f"{self._prefix}-{index}"
            fut = self._loop.create_future()
            # mark every outcome read: only the first error is raised, and asyncio logs a traceback for
            # each unread one (a refused 64-prompt request logged 63)
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
            self.request_ids.append(rid)  # before submitting, so close() aborts it whatever happens
            self._engine._submit(("add", rid, prompt_token_ids, params, _Sub(self, index, self.trace), fut, self._loop))
            futs.append(fut)

        def watch() -> None:  # every second: a loop that died before reading our messages settles none
            nonlocal timer
            if self._engine.alive:
                timer = self._loop.call_later(1.0, watch)
                return
            for fut in futs:
                if not fut.done():
                    fut.set_exception(EngineDeadError("the engine loop is not running"))

        # a timer, not asyncio.wait(timeout=1): ~90 us less right after the put, while the engine thread
        # waits for the GIL to add the request (2-vCPU VM, after a step; 3.5 against 17 us warm)
        timer = self._loop.call_later(1.0, watch)
        try:
            for fut in futs:
                await fut  # raises the admission error, if any
                self._open += 1
        finally:
            timer.cancel()

    async def updates(self, timeout: float | None = None) -> AsyncIterator[tuple[int, Any]]:
        """(index, RequestUpdate) until every sub-request has finished; raises EngineStepError."""
        while self._open > 0:
            idx, item = await asyncio.wait_for(self.queue.get(), timeout)
            if isinstance(item, BaseException):
                self._open = 0
                raise item
            if idx in self._dropped:
                continue
            if item.finished:
                self._open -= 1
                self._finished.add(idx)
            yield idx, item

    def abort(self, index: int) -> None:
        """Aborts one sub-request (its choice is complete early); updates() no longer waits for it."""
        if index in self._dropped or index in self._finished or index >= len(self.request_ids):
            return
        self._dropped.add(index)
        self._open -= 1
        self._engine._submit(("abort", self.request_ids[index]))

    def close(self) -> None:
        """Aborts whatever has not finished (client gone, error, cancellation). Idempotent."""
        for index, rid in enumerate(self.request_ids):
            # finished (its last update read) or aborted already: the engine has let it go, and an abort
            # would wake the engine thread for nothing (and refresh its stats) as the response is written
            if index not in self._finished and index not in self._dropped:
                self._engine._submit(("abort", rid))
        self.request_ids = []


class AsyncEngine:
    """After a step raises, the requests in flight fail (500) and the engine is unhealthy (/health 503,
    new requests 503) until a probe request (one token) runs through it; probes are tried PROBES times,
    PROBE_BACKOFF_S, 2x, 4x ... apart, and when none succeeds the loop ends (`fatal`; `on_fatal` is
    called: openinfer-serve exits non-zero for its supervisor)."""
    STATS_PERIOD_S = 0.01  # while busy, the metrics snapshot is refreshed at most this often
    STALE_S = 1.0  # a snapshot this old (stats() failing, a step this long) does not refuse by the queue's wait
    PROBES = 3
    PROBE_BACKOFF_S = 0.25

    def __init__(self, engine: Any, idle_poll_s: float = 0.05, max_queue_wait: float = 5.0):
        self.engine = engine
        self.max_queue_wait = max_queue_wait  # seconds; 0: only max_waiting bounds the queue
        self._inbox = queue.SimpleQueue()  # its get() waits in C: the thread wakes ~15 us sooner than Queue
        self._subs: dict[str, _Sub] = {}  # engine thread only
        self._accepted: list = []  # (loop, future) of requests added, their waiters not told yet (engine thread)
        self._stop = threading.Event()
        self._idle_poll_s = idle_poll_s
        self._ids = itertools.count()
        self.stats: dict = {}  # snapshot of engine.stats(), replaced (never mutated) by the loop
        self._stats_at = 0.0
        self.step_count = 0
        self.busy_seconds = 0.0  # wall time of loop iterations that ran a step (GPU share: gpu_s / this)
        self.fatal: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None  # called from the engine thread when the loop dies
        self.healthy = True  # False from a failed step until a probe step succeeds
        self.drain = DrainRate()
        self._refusing: str | None = None  # end_all(): why new requests are refused
        self._thread = threading.Thread(target=self._run, name="openinfer-engine", daemon=True)

    # -- asyncio side
    def start(self) -> None:
        self._refresh_stats()
        # The engine thread takes the GIL back from the event loop within 0.5 ms instead of CPython's 5 ms
        # default: under load the loop holds it while it writes responses, and the GPU waits for the
        # thread that launches the next step.
        sys.setswitchinterval(0.0005)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def max_waiting(self) -> int:
        return self.engine.scheduler.max_waiting

    def busy(self, n: int) -> str | None:
        """Why n more requests are refused with a 503 now, or None, by the latest snapshot (a 503 at once,
        not after the step running now; the engine thread still has the last word on the count): the
        waiting queue would overflow, or its oldest request has waited longer than max_queue_wait. The
        second bounds the TTFT of what is admitted under overload: the queue's head has waited about as
        long as a request queued now will. It is a measured wait, not a rate estimate: a burst at an idle
        server that fits the batch is admitted within a step or two, before its head has waited."""
        s = self.stats
        if s.get("num_waiting", 0) + n > self.max_waiting:
            return f"the waiting queue is full ({self.max_waiting} requests)"
        t = s.get("oldest_waiting_ns", 0) if time.perf_counter() - self._stats_at < self.STALE_S else 0
        if self.max_queue_wait and t and (waited := (time.perf_counter_ns() - t) * 1e-9) > self.max_queue_wait:
            return (f"the oldest waiting request has waited {waited:.1f} s, more than {self.max_queue_wait:g} s "
                    "(--max-queue-wait)")
        return None

    @property
    def refusing(self) -> str | None:
        """Why new requests are refused: shutdown (end_all), or the loop has stopped; else None."""
        return self._refusing or ("the engine loop is not running" if self._stop.is_set() else None)

    def retry_after(self) -> int:
        return self.drain.retry_after(self.stats.get("num_waiting", 0))

    def new_group(self, trace=None) -> RequestGroup:
        if not self.alive:
            raise EngineDeadError("the engine loop is not running")
        if self._refusing:
            raise EngineDeadError(self._refusing)
        return RequestGroup(self, f"req-{next(self._ids)}", trace)

    def end_all(self, reason: str) -> None:
        """Thread-safe: ends every request in flight with ShuttingDown(reason) (streams get a last error
        event) and refuses new ones; the loop itself runs on until shutdown()."""
        self._refusing = reason
        self._submit(("end", reason))

    def _submit(self, msg: tuple) -> None:
        self._inbox.put(msg)

    # -- engine thread
    def _refresh_stats(self) -> None:
        self._stats_at = time.perf_counter()
        try:
            s = self.engine.stats()
            self.stats = dict(s) if isinstance(s, dict) else dict(vars(s))
            self.drain.sample(self._stats_at, self.stats.get("num_admitted", 0))
        except Exception:  # metrics must never take the loop down
            log.exception("engine.stats() failed")

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, ids, params, sub, fut, loop = msg
            try:
                sub.seq = self.engine.add_request(rid, ids, params)
            except Exception as e:  # admission refused (or bad input): report to the waiter only
                _settle_from_thread(loop, fut, e)
                return
            sub.accepted = time.perf_counter_ns()  # in the scheduler's waiting queue now
            self._subs[rid] = sub
            # told with the next hand-over, right before the step that admits it launches: told now, the
            # event loop would wake and take the GIL while this thread schedules and packs that step
            self._accepted.append((loop, fut))
        elif kind == "end":
            self._fail_all(ShuttingDown(msg[1]))
        elif kind == "abort":
            rid = msg[1]
            if self._subs.pop(rid, None) is not None:
                try:
                    self.engine.abort_request(rid)
                except Exception:
                    log.exception("abort_request(%s) failed", rid)

    def _drain(self, block: bool) -> bool:
        """Handles every queued message; blocks briefly for the first one when idle."""
        handled = False
        try:
            msg = self._inbox.get(timeout=self._idle_poll_s) if block else self._inbox.get_nowait()
            while True:
                self._handle(msg)
                handled = True
                msg = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return handled

    def _fail_all(self, err: EngineStepError) -> None:
        """Every request in flight gets `err` and is aborted."""
        for rid, sub in list(self._subs.items()):
            sub.group._post((sub.index, err))
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort_request(%s) after a failed step failed", rid)
        self._subs.clear()

    def _post_updates(self, updates: list, step) -> None:
        """`step`: the ScheduledBatch the updates came from (its times go to the path traces)."""
        # One wake-up of the event loop per step, not one per update: each wake is a syscall during
        # which the event loop may take the GIL from this thread.
        batches: dict = {}  # loop -> (queue items, admission futures)
        for loop, fut in self._accepted:
            batches.setdefault(loop, ([], []))[1].append(fut)
        self._accepted = []
        posted = time.perf_counter_ns()
        for u in updates:
            sub = self._subs.get(u.request_id)
            if sub is None:
                continue  # aborted meanwhile
            if u.finished:
                del self._subs[u.request_id]
            if sub.trace is not None:  # this request's first update: the engine's side of its trace
                _trace_engine(sub, step, posted)
                sub.trace = None
            batches.setdefault(sub.group._loop, ([], []))[0].append((sub.group.queue, (sub.index, u)))
        for loop, (items, futs) in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver, items, futs)
            except RuntimeError:  # event loop closed: the server is shutting down
                pass

    def _run(self) -> None:
        # A step's updates are posted just before the next step launches, not as soon as they exist:
        # waking the event loop makes it take the GIL for the SSE writes, and done while the engine
        # thread still schedules, that work lands between two GPU steps instead of under one.
        pending: list = []
        pending_step = None  # the step they came from

        def flush() -> None:
            nonlocal pending
            updates, pending = pending, []
            self._post_updates(updates, pending_step)

        try:
            while not self._stop.is_set():
                t_iter = time.perf_counter()
                busy = self.engine.has_unfinished()
                if not busy:  # publish everything before waiting for work; the stats first, so that the
                    self._refresh_stats()  # event loop, woken by the flush, does not wait on them for the GIL
                    flush()
                if self._drain(block=not busy):
                    self._refresh_stats()
                if not self.engine.has_unfinished():
                    continue
                try:
                    updates = self.engine.step(before_launch=flush)
                except Exception as e:
                    log.exception("engine step failed; failing the requests in flight")
                    flush()
                    self._fail_all(EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))
                    self._recover()
                    self._refresh_stats()
                    continue
                flush()  # no-op unless the step launched nothing and collected nothing
                pending, pending_step = updates, self.engine.collected
                self.step_count += 1
                self.busy_seconds += time.perf_counter() - t_iter
                if time.perf_counter() - self._stats_at >= self.STATS_PERIOD_S:  # idle refreshes always
                    self._refresh_stats()
        except Exception as e:  # the loop itself broke: /health turns 503
            self.fatal = e
            log.exception("engine loop died")
            self._fail_all(EngineStepError(f"engine loop died: {e}"))
        finally:
            self._stop.set()
            try:
                flush()
            except Exception:
                log.exception("posting the last updates failed")
            if self._subs:  # shutdown with requests in flight: end them rather than leave them hanging
                self._fail_all(ShuttingDown("the server is shutting down"))
            self._refuse_queued()
            if self.fatal is not None and self.on_fatal is not None:
                self.on_fatal()

    def _recover(self) -> None:
        """After a failed step: unhealthy until a probe request runs through; EngineDeadError when
        PROBES probes fail (a CUDA error is sticky: every later step fails too)."""
        self.healthy = False
        for i in range(self.PROBES):
            if self._stop.wait(self.PROBE_BACKOFF_S * 2 ** i):
                return
            try:
                self._probe(f"probe-{next(self._ids)}")
            except Exception as e:
                log.warning("probe step %d/%d failed: %s: %s", i + 1, self.PROBES, type(e).__name__, e)
                continue
            self.healthy = True
            log.info("a probe step ran after the failed step: serving again")
            return
        raise EngineDeadError(f"{self.PROBES} probe steps failed after a failed step")

    def _probe(self, rid: str) -> None:
        from ..sampling_params import SamplingParams
        self.engine.add_request(rid, [0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        try:
            for _ in range(100):  # one prefill step, plus an overlapped step's collect
                self.engine.step()
                if not self.engine.has_unfinished():
                    return
            raise RuntimeError("the probe request did not finish in 100 steps")
        finally:
            self.engine.abort_request(rid)

    def _refuse_queued(self) -> None:
        """After the loop ends, fails admissions nobody will read any more."""
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                _settle_from_thread(msg[6], msg[5], EngineDeadError("the engine loop is not running"))


def _trace_engine(sub: _Sub, step, posted: int) -> None:
    """The engine's boundaries of the group's trace, from the first of its requests to yield an update."""
    tr = sub.trace
    if tr.launched or step is None or sub.seq is None:  # another choice came first; or an engine without times
        return
    tr.accepted, tr.admitted = sub.accepted, sub.seq.t_admitted
    tr.launched, tr.collected, tr.processed, tr.posted = step.t_launched, step.t_collected, step.t_processed, posted


def _deliver(items: list, admitted: list) -> None:
    for fut in admitted:
        _settle(fut, None)
    for q, item in items:
        q.put_nowait(item)


def _settle_from_thread(loop, fut: asyncio.Future, exc: BaseException | None) -> None:
    try:
        loop.call_soon_threadsafe(_settle, fut, exc)
    except RuntimeError:  # event loop closed: nobody is waiting
        pass


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():  # the waiter was cancelled; its close() aborts the request
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def now() -> float:
    return time.perf_counter()
