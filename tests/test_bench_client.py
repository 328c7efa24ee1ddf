"""CPU tests of the serving benchmark client (bench/serve_bench.py): metric definitions, arrivals,
the random dataset, and an end-to-end run against a fake SSE server with known timings."""
import asyncio
import json
import math
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import serve_bench as sb  # noqa: E402

TOKENIZER = ROOT / "src" / "openinfer" / "data" / "qwen3-tokenizer" / "tokenizer.json"


def out(ttft, chunk_times, tokens, prompt_len=10, start=0.0):
    """A successful RequestOutput whose chunks arrived at chunk_times (s after send)."""
    return sb.RequestOutput(success=True, prompt_len=prompt_len, output_tokens=tokens, ttft=ttft,
                            itl=list(np.diff(chunk_times)), latency=chunk_times[-1],
                            start_time=start, end_time=start + chunk_times[-1],
                            chunks=len(chunk_times))


# --------------------------------------------------------------------------------- metrics
def test_metric_definitions_hand_computed():
    a = out(0.1, [0.1, 0.2, 0.3, 0.4], 4)  # TPOT (0.4-0.1)/3 = 0.1, ITL 0.1 x3
    b = out(0.2, [0.2, 0.5], 5)  # one chunk carried 4 tokens: a single ITL gap of 0.3
    c = out(0.05, [0.05], 1)  # one token: no TPOT, no ITL
    fail = sb.RequestOutput(success=False, prompt_len=99, error="HTTP 500")
    m = sb.calculate_metrics([a, b, c, fail], duration_s=2.0, percentiles=(50, 90, 99))
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30 and m["total_output_tokens"] == 10
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(5.0)
    assert m["total_token_throughput"] == pytest.approx(20.0)
    # TTFT [100, 200, 50] ms
    assert m["mean_ttft_ms"] == pytest.approx(350 / 3)
    assert m["median_ttft_ms"] == pytest.approx(100)
    # linear interpolation on sorted [50, 100, 200]: p90 at rank 1.8 -> 100 + 0.8*100
    assert m["p90_ttft_ms"] == pytest.approx(180)
    assert m["p99_ttft_ms"] == pytest.approx(198)
    # TPOT only for a and b: a 100 ms, b (0.5-0.2)/4 = 75 ms
    assert m["mean_tpot_ms"] == pytest.approx(87.5)
    assert m["p99_tpot_ms"] == pytest.approx(75 + 0.99 * 25)
    # ITL pooled: [100, 100, 100, 300]
    assert m["mean_itl_ms"] == pytest.approx(150)
    assert m["median_itl_ms"] == pytest.approx(100)
    assert m["p90_itl_ms"] == pytest.approx(100 + 0.7 * 200)  # rank 2.7
    # E2EL [400, 500, 50]
    assert m["median_e2el_ms"] == pytest.approx(400)
    assert m["p50_e2el_ms"] == pytest.approx(400)


def test_tpot_excluded_when_one_output_token():
    m = sb.calculate_metrics([out(0.05, [0.05], 1), out(0.07, [0.07], 1)], 1.0)
    assert m["mean_tpot_ms"] == 0.0 and m["p99_tpot_ms"] == 0.0  # empty list reads as 0 (vLLM)
    assert m["mean_itl_ms"] == 0.0
    m = sb.calculate_metrics([out(0.05, [0.05], 1), out(0.1, [0.1, 0.3], 2)], 1.0)
    assert m["mean_tpot_ms"] == pytest.approx(200)  # only the 2-token request counts


def test_no_success_is_all_zero_not_a_crash():
    m = sb.calculate_metrics([sb.RequestOutput(error="x")], 1.0)
    assert m["completed"] == 0 and m["failed"] == 1 and m["mean_ttft_ms"] == 0.0


# --------------------------------------------------------------------------------- arrivals
def test_poisson_arrivals_seeded_with_mean_gap():
    a = sb.arrival_offsets(20000, 8.0, 1.0, seed=42)
    b = sb.arrival_offsets(20000, 8.0, 1.0, seed=42)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, sb.arrival_offsets(20000, 8.0, 1.0, seed=43))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    gaps = np.diff(a)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.05)  # exponential: std == mean
    # burstiness 4: same mean gap, lower variance (gamma shape 4 -> cv 1/2)
    g4 = np.diff(sb.arrival_offsets(20000, 8.0, 4.0, seed=1))
    assert g4.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert g4.std() == pytest.approx(0.5 / 8.0, rel=0.05)
    assert np.all(sb.arrival_offsets(5, math.inf) == 0)


# --------------------------------------------------------------------------------- dataset
@pytest.fixture(scope="module")
def tok():
    return sb.load_tokenizer(tokenizer=str(TOKENIZER))


def test_random_dataset_lengths_no_specials_seeded(tok):
    special = sb.special_token_ids(tok)
    assert 151643 in special and 151645 in special  # <|endoftext|>, <|im_end|>
    allowed = sb.allowed_token_ids(tok)
    assert not (set(allowed.tolist()) & special)
    reqs = sb.sample_random_requests(tok, 16, input_len=256, output_len=32, seed=42)
    assert len(reqs) == 16
    for r in reqs:
        ids = tok.encode(r.prompt, add_special_tokens=False).ids
        assert len(ids) == r.prompt_len == 256
        assert not (set(ids) & special)
        assert r.expected_output_len == 32
    again = sb.sample_random_requests(tok, 16, input_len=256, output_len=32, seed=42)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    other = sb.sample_random_requests(tok, 16, input_len=256, output_len=32, seed=7)
    assert [r.prompt for r in other] != [r.prompt for r in reqs]
    assert len({r.prompt for r in reqs}) == 16


def test_random_dataset_range_ratio(tok):
    reqs = sb.sample_random_requests(tok, 32, input_len=100, output_len=20, seed=0, range_ratio=0.5)
    assert all(50 <= r.prompt_len <= 150 for r in reqs)
    assert all(10 <= r.expected_output_len <= 30 for r in reqs)
    assert len({r.expected_output_len for r in reqs}) > 1


# --------------------------------------------------------------------------------- end to end
TTFT_S, GAP_S, CHUNKS, TOKENS_PER_CHUNK = 0.08, 0.02, 6, 2


def make_app(state):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    async def health(request):
        return PlainTextResponse("ok")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def completions(request):
        body = await request.json()
        state["bodies"].append(body)
        if state["fail_every"] and len(state["bodies"]) % state["fail_every"] == 0:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        t0 = time.perf_counter()

        async def gen():
            yield ": keep-alive comment\n\n"
            await asyncio.sleep(TTFT_S)
            for i in range(CHUNKS):
                if i:
                    await asyncio.sleep(GAP_S)
                chunk = {"id": "c", "object": "text_completion", "model": body["model"],
                         "choices": [{"index": 0, "text": "ab", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            state["spans"].append(time.perf_counter() - t0)  # sleeps overshoot on a busy machine
            usage = {"prompt_tokens": 5, "completion_tokens": CHUNKS * TOKENS_PER_CHUNK,
                     "total_tokens": 5 + CHUNKS * TOKENS_PER_CHUNK}
            yield f"data: {json.dumps({'id': 'c', 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/completions", completions, methods=["POST"])])


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    state = {"bodies": [], "fail_every": 0, "spans": []}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    th.join(timeout=5)


def run_bench(base_url, reqs, **kw):
    return asyncio.run(sb.benchmark(base_url=base_url, requests=reqs, progress=False, **kw))


def fixed_requests(n, out_len=12):
    return [sb.SampleRequest(prompt=f"hello {i}", prompt_len=5, expected_output_len=out_len)
            for i in range(n)]


def test_end_to_end_metrics_match_fake_server(fake_server):
    url, state = fake_server
    state["bodies"].clear()
    m, outs = run_bench(url, fixed_requests(4), request_rate=math.inf, max_concurrency=4,
                        percentiles=(50, 99))
    assert m["model_id"] == "fake-model" and m["completed"] == 4 and m["failed"] == 0
    body = state["bodies"][-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["max_tokens"] == 12 and body["prompt"].startswith("hello ")
    assert len(state["bodies"]) == 5  # the initial test request + 4
    tol = 0.03
    # E2EL against the span the server actually took to send the last chunk (its sleeps may overshoot)
    e2el = float(np.median(state["spans"][-4:]))
    assert e2el >= TTFT_S + (CHUNKS - 1) * GAP_S
    assert TTFT_S - 0.005 <= m["median_ttft_ms"] / 1e3 <= TTFT_S + tol
    assert GAP_S - 0.005 <= m["median_itl_ms"] / 1e3 <= GAP_S + tol
    assert e2el - 0.005 <= m["median_e2el_ms"] / 1e3 <= e2el + tol
    ntok = CHUNKS * TOKENS_PER_CHUNK
    for o in outs:
        assert o.output_tokens == ntok and o.chunks == CHUNKS and len(o.itl) == CHUNKS - 1
        assert o.generated_text == "ab" * CHUNKS
        assert o.latency == pytest.approx(o.ttft + sum(o.itl))
    # a chunk carrying 2 tokens is one ITL gap; TPOT divides by tokens - 1
    assert m["mean_tpot_ms"] == pytest.approx(
        np.mean([(o.latency - o.ttft) / (ntok - 1) for o in outs]) * 1e3)
    assert m["total_output_tokens"] == 4 * ntok
    assert m["output_throughput"] == pytest.approx(4 * ntok / m["duration"])
    assert e2el <= m["duration"] <= e2el + 0.2  # all four at once


def test_max_concurrency_queueing_excluded_from_ttft(fake_server):
    url, _ = fake_server
    m, outs = run_bench(url, fixed_requests(3), request_rate=math.inf, max_concurrency=1,
                        initial_test=False)
    e2el = TTFT_S + (CHUNKS - 1) * GAP_S
    assert m["completed"] == 3
    # no queueing in TTFT: a queued request's would be at least e2el + TTFT_S (0.26 s); the margin is for a loaded host
    assert max(o.ttft for o in outs) < TTFT_S + e2el / 2
    starts = sorted(o.start_time for o in outs)
    assert min(np.diff(starts)) >= e2el - 0.005  # strictly one at a time
    assert 3 * e2el <= m["duration"] <= 3 * e2el + 0.3


def test_poisson_rate_and_closed_loop_duration(fake_server):
    url, _ = fake_server
    m, outs = run_bench(url, fixed_requests(6), request_rate=20.0, seed=3, initial_test=False)
    starts = np.array(sorted(o.start_time for o in outs))
    expect = sb.arrival_offsets(6, 20.0, 1.0, seed=3)
    assert np.allclose(starts - starts[0], expect, atol=0.03)
    m, outs = run_bench(url, fixed_requests(2), request_rate=math.inf, max_concurrency=2,
                        duration=0.5, initial_test=False)
    e2el = TTFT_S + (CHUNKS - 1) * GAP_S
    assert m["failed"] == 0 and 2 * 2 <= m["completed"] <= 2 * math.ceil(0.5 / e2el) + 2


def test_http_errors_count_as_failed(fake_server):
    url, state = fake_server
    state["bodies"].clear()
    state["fail_every"] = 2
    try:
        m, outs = run_bench(url, fixed_requests(6), request_rate=math.inf, initial_test=False)
    finally:
        state["fail_every"] = 0
    assert m["completed"] == 3 and m["failed"] == 3
    assert any(k.startswith("HTTP 500") for k in m["errors"])
    # nothing listening: connection errors are failures too, not a crash
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    m, _ = run_bench(f"http://127.0.0.1:{dead}", fixed_requests(2), model="x", initial_test=False,
                     request_timeout=5.0)
    assert m["completed"] == 0 and m["failed"] == 2


def test_cli_writes_result_json(fake_server, tmp_path):
    url, _ = fake_server
    path = tmp_path / "r.json"
    rc = sb.main(["--base-url", url, "--tokenizer", str(TOKENIZER), "--num-prompts", "3",
                  "--random-input-len", "32", "--random-output-len", "4", "--seed", "42",
                  "--request-rate", "inf", "--max-concurrency", "2", "--result-json", str(path),
                  "--no-progress"])
    assert rc == 0
    res = json.loads(path.read_text())
    assert res["completed"] == 3 and res["args"]["seed"] == 42
    assert res["args"]["request_rate"] == "inf" and res["args"]["max_concurrency"] == 2
    for k in ("date", "command", "machine", "git", "mean_ttft_ms", "p99_tpot_ms",
              "median_itl_ms", "p90_e2el_ms", "output_throughput", "total_input_tokens"):
        assert k in res
    assert res["total_input_tokens"] == 3 * 32
    assert "hostname" in res["machine"]


def test_timeline_marginals_add_up_to_the_step():
    """bench/timeline_summary.py: kernels that overlap (programmatic dependent launch) are charged only
    for what they add past the latest end before them; steps split at the step's embedding kernel."""
    import timeline_summary as ts
    us = 1000  # ns
    kern = [  # (start, duration, name): two steps, the second embedding of each gathers the sampled rows
        (0, 2 * us, "embedding_kernel"), (1 * us, 10 * us, "gemv_kernel<1, 1, 0>"),
        (5 * us, 4 * us, "qk_norm_rope_kv_kernel"),  # ends inside its predecessor: marginal 0
        (9 * us, 6 * us, "gemv_kernel<1, 0, 1>"), (15 * us, 1 * us, "embedding_kernel"),
        (16 * us, 20 * us, "gemv_kernel<1, 1, 2>"), (30 * us, 10 * us, "sample_kernel"),
        (50 * us, 2 * us, "embedding_kernel"), (52 * us, 10 * us, "gemv_kernel<1, 1, 0>"),
        (62 * us, 1 * us, "embedding_kernel"), (63 * us, 5 * us, "gemv_kernel<1, 1, 2>"),
        (67 * us, 3 * us, "sample_kernel"),
    ]
    steps = ts.split_steps(kern)
    assert [len(s) for s in steps] == [7, 5]
    spans, marg, dur = ts.marginals(steps)
    assert spans == [40.0, 20.0]
    assert marg["qk_norm_rope_kv_kernel after gemv_kernel<1, 1, 0>"] == [0.0]
    assert marg["gemv_kernel<1, 0, 1> after qk_norm_rope_kv_kernel"] == [4.0]  # 15 - 11
    assert marg["sample_kernel after gemv_kernel<1, 1, 2>"] == [4.0, 2.0]
    assert dur["sample_kernel after gemv_kernel<1, 1, 2>"] == [10.0, 3.0]
    for step, span in zip(steps, spans):  # each step's marginals add up to its span
        _, m, _ = ts.marginals([step])
        assert abs(sum(sum(v) for v in m.values()) - span) < 1e-9
