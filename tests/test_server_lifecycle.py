"""`openinfer-serve` processes through their lifetime (issue #26): SIGTERM with requests in flight
(--shutdown-timeout), an engine that cannot recover from a failed step (exit status 1 for a
supervisor), and --num-kv-blocks. Real subprocesses on the tiny checkpoint (CPU backend)."""

import json
import signal
import threading
import time

import httpx
import pytest

from cli_util import ServerProcess
from openinfer.cli import build_parser, engine_config, server_config
from test_server_harness import metric, wait_until


def _stream(url, body, out: dict, key: str):
    """POSTs a streamed completion; out[key] = the SSE data of every event, as read."""
    events = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    except httpx.HTTPError as e:  # a cut stream: what the issue saw before
        events.append(e)
    out[key] = events


def _post(url, body, out: dict, key: str):
    try:
        out[key] = httpx.post(url + "/v1/completions", json=body, timeout=60)
    except httpx.HTTPError as e:
        out[key] = e


def test_flags_set_the_kv_pool_and_the_timeouts(tiny_dir):
    a = build_parser().parse_args(["--model-path", str(tiny_dir), "--num-kv-blocks", "100", "--shutdown-timeout",
                                   "2.5", "--body-read-timeout", "4"])
    c, s = engine_config(a), server_config(a)
    assert c.num_kv_blocks == 100 and c.gpu_num_kv_blocks == 100  # the CUDA engine's option (csrc/engine/options.h)
    assert c.cpu_num_kv_blocks() == 100
    assert (s.shutdown_timeout, s.body_read_timeout) == (2.5, 4)
    assert engine_config(build_parser().parse_args(["--model-path", str(tiny_dir)])).gpu_num_kv_blocks == 0  # from memory


def test_sigterm_finishes_what_it_can_ends_the_rest_and_exits_0(cli_env, tiny_dir):
    """SIGTERM: no new connections; a request that finishes within --shutdown-timeout finishes; the rest
    end then, a stream with an error event and [DONE], a non-streamed one with an OpenAI-style 503; the
    process exits 0 without a traceback."""
    # 5 s: the short request's 20 steps take ~1 s alone, 3 s and more on a loaded 2-core CI runner
    srv = ServerProcess(cli_env, tiny_dir, "--max-model-len", "2048", "--num-kv-blocks", "100",
                        "--shutdown-timeout", "5")
    out = {}
    try:
        assert metric(srv.url, "openinfer_kv_blocks_free") == 99  # --num-kv-blocks 100, block 0 reserved
        short = {"prompt": "a", "max_tokens": 20, "ignore_eos": True}  # ~20 steps a second: done in ~1 s
        long = {"prompt": "b", "max_tokens": 700, "ignore_eos": True}  # ~40 s; two of them and the short fit 99 blocks
        threads = [threading.Thread(target=_stream, args=(srv.url, long, out, "long")),
                   threading.Thread(target=_post, args=(srv.url, long, out, "plain")),
                   threading.Thread(target=_stream, args=(srv.url, short, out, "short"))]
        for t in threads[:2]:
            t.start()
        assert wait_until(lambda: metric(srv.url, "openinfer_num_requests_running") == 2, 20)
        threads[2].start()
        assert wait_until(lambda: metric(srv.url, "openinfer_num_requests_running") == 3, 5, 0.01)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: _refused(srv.url), 2)  # stops accepting at once
        for t in threads:
            t.join(30)
        code, log = srv.wait(20)
        took = time.monotonic() - t0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert code == 0 and "Traceback" not in log, log
    assert out["short"][-1] == "[DONE]" and out["short"][-2]["choices"][0]["finish_reason"] == "length"
    long_events = out["long"]
    assert long_events[-1] == "[DONE]", long_events[-3:]
    err = long_events[-2]["error"]
    assert err["code"] == "server_shutting_down" and "--shutdown-timeout" in err["message"], err
    assert sum("choices" in e for e in long_events[:-2]) > 5  # it ran until the deadline
    plain = out["plain"]
    assert isinstance(plain, httpx.Response) and plain.status_code == 503, plain
    assert plain.json()["error"]["code"] == "server_shutting_down"
    assert 5 <= took < 15, took


def _refused(url) -> bool:
    """A new connection is not served: refused, or (while uvicorn closes its socket) accepted and closed
    without an answer."""
    try:
        httpx.get(url + "/health", timeout=1)
    except (httpx.ConnectError, httpx.RemoteProtocolError):
        return True
    return False


def test_engine_that_cannot_recover_exits_1(cli_env, tiny_dir):
    """Every step from the 3rd raises (OPENINFER_TEST_FAULT=3:0, as a dead CUDA context does): the
    request fails (error event, [DONE]), /health turns 503, the probes fail, and the process exits with
    status 1 for its supervisor, in seconds, not hanging."""
    srv = ServerProcess(cli_env, tiny_dir, "--max-model-len", "512", extra_env={"OPENINFER_TEST_FAULT": "3:0"})
    out = {}
    try:
        _stream(srv.url, {"prompt": "a", "max_tokens": 50, "ignore_eos": True}, out, "s")
        t0 = time.monotonic()
        health = httpx.get(srv.url + "/health", timeout=5).status_code
        code, log = srv.wait(20)
        took = time.monotonic() - t0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    events = out["s"]
    assert events[-1] == "[DONE]" and "CUDA error" in events[-2]["error"]["message"], events[-3:]
    assert health == 503
    assert code == 1 and "3 probe steps failed" in log and "exiting with status 1" in log, log
    assert took < 10, took
