"""The request path trace (server/metrics.py PathTrace, `openinfer_request_path_seconds`): for served
requests of both endpoints, streamed and not, every boundary is stamped, in order, within what the client
saw; /metrics carries each kind's phases; requests that fail or engines without step times add nothing."""
import time

import httpx
import pytest

from openinfer import EngineConfig, LLMEngine, SamplingParams
from openinfer.server.metrics import PATH, PATH_BUCKETS_NS, PATH_PHASES, PathHistogram, PathTrace

from test_server_harness import RunningServer

NAME = "tiny-trace"
KINDS = [(e, s) for e in ("completions", "chat_completions") for s in (False, True)]
BODY = {"completions": {"prompt": "The capital of France is"},
        "chat_completions": {"messages": [{"role": "user", "content": "What is the capital of France?"}]}}


@pytest.fixture(scope="module")
def srv(tiny_dir):
    engine = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", max_model_len=1024, num_kv_blocks=64))
    s = RunningServer(engine, served_model_name=NAME)
    s.traces = []
    path = s.state.metrics.path
    observe = path.observe

    def keep(trace):  # every trace the server observes, kept for the tests to read
        s.traces.append(trace)
        observe(trace)
    path.observe = keep
    yield s
    s.stop()
    engine.close()


def send(srv, endpoint: str, stream: bool, max_tokens: int = 1, **extra) -> tuple[int, int, PathTrace]:
    """(perf_counter_ns before the request is written, after the response is read, its trace)."""
    body = dict(BODY[endpoint], model=NAME, max_tokens=max_tokens, temperature=0, ignore_eos=True,
                stream=stream, **extra)
    n = len(srv.traces)
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        c.get("/health")  # the connection is open before the clock starts
        t0 = time.perf_counter_ns()
        if stream:
            with c.stream("POST", f"/v1/{endpoint.replace('_', '/')}", json=body) as r:
                assert r.status_code == 200
                lines = [x for x in r.iter_lines() if x.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
        else:
            r = c.post(f"/v1/{endpoint.replace('_', '/')}", json=body)
            assert r.status_code == 200, r.text
        t1 = time.perf_counter_ns()
    # a stream's trace is observed as the stream closes, which may be just after the client has read it all
    deadline = time.monotonic() + 5
    while len(srv.traces) == n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(srv.traces) == n + 1, "the request's trace was not observed"
    tr = srv.traces[-1]
    return t0, t1, tr


def stamps(tr: PathTrace) -> list[tuple[str, int]]:
    """The boundaries this trace has, in PATH order, after its arrival."""
    return [("arrival", tr.arrival)] + [(b, getattr(tr, b)) for _, b in PATH if getattr(tr, b)]


@pytest.mark.parametrize("max_tokens", [1, 3])
@pytest.mark.parametrize("endpoint,stream", KINDS)
def test_phases_are_stamped_in_order_within_the_client_latency(srv, endpoint, stream, max_tokens):
    t0, t1, tr = send(srv, endpoint, stream, max_tokens)
    assert (tr.endpoint, tr.stream) == (endpoint, stream)
    have = {b for b, t in stamps(tr)}
    want = {b for _, b in PATH} - ({"last"} if stream else set()) - (set() if endpoint == "chat_completions"
                                                                     else {"templated"})
    assert have == want | {"arrival"}, "a boundary is missing or one the request does not have is stamped"
    seq = stamps(tr)
    for (a, ta), (b, tb) in zip(seq, seq[1:]):
        assert ta <= tb, f"{b} ({tb}) is before {a} ({ta})"
    durs = tr.phases()
    assert durs is not None and len(durs) == len(PATH_PHASES)
    assert all(d is None or d >= 0 for d in durs)
    assert sum(d for d in durs if d is not None) == tr.sent - tr.arrival
    # everything stamped happened while the client waited
    assert t0 <= tr.arrival and tr.sent <= t1, (t0, tr.arrival, tr.sent, t1)
    assert tr.sent - tr.arrival <= t1 - t0
    # the step is the engine's: it ran between admission and collection, and took real time on the CPU
    assert tr.collected - tr.launched > 0
    if not stream and max_tokens > 1:
        assert tr.last > tr.delivered  # the body waited for the later tokens


def test_several_choices_trace_the_first_update(srv):
    t0, t1, tr = send(srv, "completions", False, max_tokens=2, n=3)
    seq = stamps(tr)
    assert all(ta <= tb for (_, ta), (_, tb) in zip(seq, seq[1:]))
    assert t0 <= tr.arrival and tr.sent <= t1


def scrape(srv) -> dict:
    """{(phase, endpoint, stream): count} of openinfer_request_path_seconds."""
    out = {}
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if line.startswith("openinfer_request_path_seconds_count{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            key = (labels["phase"].strip('"'), labels["endpoint"].strip('"'), labels["stream"].strip('"'))
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def test_metrics_carry_each_kinds_phases(srv):
    before = scrape(srv)
    for endpoint, stream in KINDS:
        for _ in range(2):
            send(srv, endpoint, stream, max_tokens=2)
    after = scrape(srv)
    for endpoint, stream in KINDS:
        s = "true" if stream else "false"
        phases = {p for (p, e, st) in after if (e, st) == (endpoint, s)}
        want = set(PATH_PHASES) - ({"decode"} if stream else set()) - (
            set() if endpoint == "chat_completions" else {"template"})
        assert phases == want, (endpoint, stream)
        for p in want:
            assert after[(p, endpoint, s)] - before.get((p, endpoint, s), 0) == 2, (p, endpoint, stream)


def test_refused_requests_are_not_observed(srv):
    before = scrape(srv)
    r = httpx.post(srv.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 5000})
    assert r.status_code == 400
    r = httpx.post(srv.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400
    assert scrape(srv) == before


def test_histogram_buckets_sum_and_text():
    h = PathHistogram()
    tr = PathTrace("completions", 1_000)
    t = tr.arrival
    for i, (_, b) in enumerate(PATH):
        if b == "templated":
            continue
        t += 1_500 * (i + 1)  # route 1.5 us, body 3 us, ...
        setattr(tr, b, t)
    durs = tr.phases()
    assert durs[PATH_PHASES.index("route")] == 1_500 and durs[PATH_PHASES.index("template")] is None
    h.observe(tr)
    text = h.render()
    assert "# TYPE openinfer_request_path_seconds histogram" in text
    lab = 'endpoint="completions",phase="route",stream="false"'
    assert f'openinfer_request_path_seconds_bucket{{{lab},le="1e-06"}} 0.0' in text
    assert f'openinfer_request_path_seconds_bucket{{{lab},le="2e-06"}} 1.0' in text  # 1.5 us: the 2 us bucket
    assert f'openinfer_request_path_seconds_bucket{{{lab},le="+Inf"}} 1.0' in text
    assert f"openinfer_request_path_seconds_sum{{{lab}}} 1.5e-06" in text
    assert 'phase="template"' not in text  # completions have none
    n_series = sum(d is not None for d in durs)
    assert text.count("_count{") == n_series
    assert text.count("_bucket{") == n_series * (len(PATH_BUCKETS_NS) + 1)


def test_incomplete_traces_are_not_observed():
    h = PathHistogram()
    tr = PathTrace("completions", 1)
    for _, b in PATH:
        setattr(tr, b, 2)
    tr.launched = 0  # an engine that keeps no step times
    assert tr.phases() is None
    h.observe(tr)
    assert "_count{" not in h.render()


@pytest.mark.parametrize("overlap", [True, False])
def test_engine_stamps_admission_and_its_steps(tiny_dir, overlap):
    eng = LLMEngine(EngineConfig(str(tiny_dir), device="cpu", max_model_len=256, num_kv_blocks=16,
                                 overlap_steps=overlap))
    try:
        t0 = time.perf_counter_ns()
        seq = eng.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2, temperature=0.0))
        assert seq.t_admitted == 0  # queued, not admitted yet
        first = None
        while eng.has_unfinished():
            ups = eng.step()
            if ups and first is None:
                first = eng.collected
                assert t0 < seq.t_admitted <= first.t_launched <= first.t_collected <= first.t_processed
                assert first.t_processed <= time.perf_counter_ns()
                assert any(it.seq is seq for it in first.items)
        assert first is not None
    finally:
        eng.close()


def test_gc_pauses_are_timed_only_while_the_app_runs():
    """Collections are timed between the app's start and close, never from a Metrics the app did not start
    (nothing left in gc.callbacks), and the callback itself only queues (a collection can start on a thread
    that holds a metric's lock): the pause reaches the histogram at the next render."""
    import gc
    from types import SimpleNamespace

    from openinfer.server.metrics import Metrics
    m = Metrics(SimpleNamespace(stats={}, alive=True, step_count=0, busy_seconds=0.0), "m")
    assert m._on_gc not in gc.callbacks
    m.start()
    try:
        assert m._on_gc in gc.callbacks
        gc.collect(2)
        assert m._gc_done and m.gc_pause.labels("2")._sum.get() == 0  # queued, not yet observed
        count = next(line.split()[-1] for line in m.render().decode().splitlines()
                     if line.startswith('openinfer_gc_pause_seconds_count{generation="2"}'))
        assert float(count) >= 1 and not m._gc_done
    finally:
        m.close()
    assert m._on_gc not in gc.callbacks


def test_request_latencies_are_observed_by_the_next_flush():
    """TTFT, e2e and TPOT are queued as tokens arrive and observed by the loop's watch or a scrape."""
    from types import SimpleNamespace
    from openinfer.server.metrics import Metrics, RequestTimer
    m = Metrics(SimpleNamespace(stats={}, alive=True, step_count=0, busy_seconds=0.0), "m")
    t = RequestTimer(m, 10.0)
    t.tokens_arrived(1, 10.5)
    t.tokens_arrived(2, 11.5)
    t.finish()
    count = lambda h: [s.value for s in h.collect()[0].samples if s.name.endswith("_count")][0]  # noqa: E731
    assert count(m.ttft) == count(m.e2e) == count(m.tpot) == 0
    text = m.render().decode()
    assert count(m.ttft) == count(m.e2e) == count(m.tpot) == 1
    assert "openinfer_time_to_first_token_seconds_sum 0.5" in text
    assert "openinfer_e2e_request_latency_seconds_sum 1.5" in text
    assert "openinfer_time_per_output_token_seconds_sum 0.5" in text
