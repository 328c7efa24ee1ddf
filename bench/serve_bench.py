#!/usr/bin/env python3
"""Serving benchmark client with `vllm bench serve --backend openai` semantics.

Random dataset (token ids from the vocabulary minus special ids at a seeded offset, decoded to
text), POST /v1/completions with stream=true and usage, Poisson (gamma) arrivals or an in-flight
cap, and TTFT / TPOT / ITL / E2EL statistics computed the way vLLM computes them. See
bench/README.md and ../shared/design/BENCHMARKS.md.

    python3 bench/serve_bench.py --model-path DIR --request-rate 8 --num-prompts 480 \
        --seed 42 --result-json bench/results/x.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGED_TOKENIZER = REPO_ROOT / "src" / "openinfer" / "data" / "qwen3-tokenizer" / "tokenizer.json"
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


@dataclass
class RequestOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0  # usage.completion_tokens
    ttft: float = 0.0  # s, send -> first chunk with non-empty choices
    itl: list[float] = field(default_factory=list)  # s, gaps between successive chunks
    latency: float = 0.0  # s, E2EL: send -> last chunk with choices
    start_time: float = 0.0  # perf_counter just before the POST
    end_time: float = 0.0  # perf_counter when the request finished (stream closed or failed)
    generated_text: str = ""
    chunks: int = 0
    error: str = ""


# ---------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------
def find_tokenizer_file(model_path: str | None = None, tokenizer: str | None = None) -> Path:
    """--tokenizer (file or dir) > MODEL_DIR/tokenizer.json > the packaged Qwen3 tokenizer."""
    for cand in (tokenizer, model_path):
        if not cand:
            continue
        p = Path(cand)
        if p.is_dir():
            p = p / "tokenizer.json"
        if p.is_file():
            return p
        if cand is tokenizer:
            raise FileNotFoundError(f"tokenizer not found: {cand}")
    return PACKAGED_TOKENIZER


def load_tokenizer(model_path: str | None = None, tokenizer: str | None = None):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(find_tokenizer_file(model_path, tokenizer)))


def special_token_ids(tok) -> set[int]:
    return {i for i, t in tok.get_added_tokens_decoder().items() if t.special}


def allowed_token_ids(tok) -> np.ndarray:
    """Base vocabulary (HF `vocab_size`, no added tokens) minus special ids, ascending."""
    vocab_size = tok.get_vocab_size(with_added_tokens=False)
    return np.setdiff1d(np.arange(vocab_size), np.fromiter(special_token_ids(tok), dtype=np.int64))


def _decode_to_target_len(tok, seqs: list[list[int]], targets: list[int], rng, allowed,
                          max_retry: int = 10) -> tuple[list[str], list[int]]:
    """vLLM's gen_prompt_decode_to_target_len, batched: decode, re-encode, truncate or pad with
    random allowed ids, at most max_retry rounds. Returns prompts and their token counts."""
    n = len(seqs)
    prompts: list[str] = [""] * n
    lens = [0] * n
    todo = list(range(n))
    for round_ in range(max_retry + 1):
        if not todo:
            break
        texts = tok.decode_batch([seqs[i] for i in todo], skip_special_tokens=False)
        encs = tok.encode_batch(texts, add_special_tokens=False)
        nxt = []
        for i, text, enc in zip(todo, texts, encs):
            ids = list(enc.ids)
            prompts[i], lens[i] = text, len(ids)
            if len(ids) == targets[i] or round_ == max_retry:
                continue
            if len(ids) < targets[i]:
                ids += allowed[rng.integers(0, len(allowed), size=targets[i] - len(ids))].tolist()
            else:
                ids = ids[: targets[i]]
            seqs[i] = ids
            nxt.append(i)
        todo = nxt
    return prompts, lens


def sample_random_requests(tok, num_requests: int, input_len: int = 1024, output_len: int = 128,
                           seed: int = 0, range_ratio: float = 0.0,
                           prefix_len: int = 0) -> list[SampleRequest]:
    """vLLM RandomDataset: lengths uniform in [L(1-r), L(1+r)], request i gets the allowed ids
    (offset_i + i + arange(len)) % |allowed|, decoded to text and re-encoded to the target length."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError("range_ratio must be in [0, 1)")
    if num_requests <= 0:
        return []
    rng = np.random.default_rng(seed)
    vocab_size = tok.get_vocab_size(with_added_tokens=False)
    in_lo, in_hi = math.floor(input_len * (1 - range_ratio)), math.ceil(input_len * (1 + range_ratio))
    out_lo = max(math.floor(output_len * (1 - range_ratio)), 1)
    out_hi = max(math.ceil(output_len * (1 + range_ratio)), 1)
    if prefix_len + in_lo < 1:
        raise ValueError("input length too small")
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    offsets = rng.integers(0, vocab_size, size=num_requests)
    allowed = allowed_token_ids(tok)
    prefix: list[int] = []
    if prefix_len > 0:
        pre = [allowed[rng.integers(0, len(allowed), size=prefix_len)].tolist()]
        _decode_to_target_len(tok, pre, [prefix_len], rng, allowed)
        prefix = pre[0]
    seqs = [prefix + allowed[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed)].tolist()
            for i in range(num_requests)]
    targets = [len(prefix) + int(x) for x in input_lens]
    prompts, lens = _decode_to_target_len(tok, seqs, targets, rng, allowed)
    return [SampleRequest(p, n, int(o)) for p, n, o in zip(prompts, lens, output_lens)]


def multiturn_conversations(tok, num_conversations: int, turns: int, turn_input_len: int, output_len: int,
                            seed: int = 0) -> list[list[SampleRequest]]:
    """Chats of growing context, as token ids: turn t's prompt is turn t-1's prompt, then output_len
    tokens standing in for the reply, then turn_input_len new user tokens. So each turn's prompt
    extends the last one's (its blocks can be served from a cache), and conversations share nothing."""
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(tok)
    convs = []
    for _ in range(num_conversations):
        prompt: list[int] = []
        conv = []
        for t in range(turns):
            if t:
                prompt = prompt + allowed[rng.integers(0, len(allowed), output_len)].tolist()
            prompt = prompt + allowed[rng.integers(0, len(allowed), turn_input_len)].tolist()
            conv.append(SampleRequest(prompt, len(prompt), output_len))
        convs.append(conv)
    return convs


async def benchmark_multiturn(*, base_url: str, conversations: list[list[SampleRequest]], max_concurrency: int,
                              model: str | None = None, endpoint: str = "/v1/completions",
                              request_timeout: float = 600.0, percentiles=(90, 99)) -> tuple[dict, list]:
    """Every conversation's turns in order, a turn sent once the one before has finished; ready turns
    (each conversation's next) are served first come first served by max_concurrency workers, so every
    conversation stays live and the working set is all of their histories at once."""
    import httpx

    _raise_nofile_limit()
    limits = httpx.Limits(max_connections=max_concurrency + 4, max_keepalive_connections=max_concurrency + 4)
    timeout = httpx.Timeout(connect=30.0, read=request_timeout, write=30.0, pool=request_timeout)
    url = base_url.rstrip("/") + endpoint
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        model = model or await _discover_model(client, base_url) or "default"
        metrics0 = await _scrape_metrics(client, base_url)
        ready: asyncio.Queue = asyncio.Queue()
        for c in range(len(conversations)):
            ready.put_nowait((c, 0))
        remaining = sum(len(c) for c in conversations)
        outputs: list[RequestOutput] = []
        done = asyncio.Event()

        async def worker():
            nonlocal remaining
            while not done.is_set():
                try:
                    c, t = await asyncio.wait_for(ready.get(), 0.5)
                except asyncio.TimeoutError:
                    continue
                o = await send_request(client, url, model, conversations[c][t], timeout_s=request_timeout)
                outputs.append(o)
                remaining -= 1
                if t + 1 < len(conversations[c]):
                    ready.put_nowait((c, t + 1))
                if remaining == 0:
                    done.set()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max_concurrency)))
        dur = time.perf_counter() - t0
        metrics1 = await _scrape_metrics(client, base_url)
    m = calculate_metrics(outputs, dur, percentiles)
    d = {k: metrics1.get(k, 0.0) - metrics0.get(k, 0.0) for k in metrics1}
    prompt_tokens = d.get("openinfer_prefix_cache_query_tokens", 0.0)
    gpu, host = d.get("openinfer_prefix_cache_hit_tokens", 0.0), d.get("openinfer_host_restored_tokens", 0.0)
    m.update(conversations=len(conversations), turns=len(conversations[0]), max_concurrency=max_concurrency,
             server_prompt_tokens=prompt_tokens, server_gpu_hit_tokens=gpu, server_host_hit_tokens=host,
             prefix_hit_rate=(gpu + host) / prompt_tokens if prompt_tokens else 0.0,
             server_restored_bytes=d.get("openinfer_host_restored_bytes", 0.0),
             server_restore_seconds=d.get("openinfer_host_restore_seconds", 0.0),
             errors={o.error: 1 for o in outputs if o.error})
    return m, outputs


# ---------------------------------------------------------------------------------------------
# Arrivals
# ---------------------------------------------------------------------------------------------
def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send time of each request in seconds after the first. Gaps ~ gamma(shape=burstiness,
    scale=1/(rate*burstiness)) (Poisson for burstiness 1); the first request goes at 0 and each
    gap follows a send, as in vLLM. rate = inf sends everything at once."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(request_rate):
        return np.zeros(n)
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request_rate and burstiness must be > 0")
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                                             size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


# ---------------------------------------------------------------------------------------------
# One request
# ---------------------------------------------------------------------------------------------
async def send_request(client, url: str, model: str, req: SampleRequest, *, ignore_eos: bool = True,
                       temperature: float = 0.0, timeout_s: float = 600.0,
                       extra_body: dict | None = None) -> RequestOutput:
    payload = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.expected_output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
    }
    if extra_body:
        payload.update(extra_body)
    out = RequestOutput(prompt_len=req.prompt_len)
    text: list[str] = []
    st = time.perf_counter()
    last = st

    async def _stream():
        nonlocal last
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = b""
                async for part in resp.aiter_bytes():
                    body += part
                    if len(body) > 1000:
                        break
                out.error = f"HTTP {resp.status_code}: {body[:300].decode('utf-8', 'replace')}"
                return
            buf = b""
            async for raw in resp.aiter_bytes():
                ts = time.perf_counter()  # arrival of this read; its events share it
                buf += raw
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):  # blank, ":" comment, event:/id: lines
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        return
                    obj = json.loads(data)
                    if obj.get("error"):
                        out.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                        return
                    if choices := obj.get("choices"):
                        if out.chunks == 0:
                            out.ttft = ts - st
                        else:
                            out.itl.append(ts - last)
                        last = ts
                        out.chunks += 1
                        text.append(choices[0].get("text") or "")
                    if usage := obj.get("usage"):
                        out.output_tokens = int(usage.get("completion_tokens") or 0)

    out.start_time = st
    try:
        await asyncio.wait_for(_stream(), timeout_s)
        if not out.error and out.chunks == 0:
            out.error = "Never received a valid chunk to calculate TTFT."
    except asyncio.TimeoutError:
        out.error = f"timeout after {timeout_s:.0f} s"
    except Exception as e:  # noqa: BLE001 - a failed request must not crash the run
        out.error = f"{type(e).__name__}: {e}"[:300] or type(e).__name__
    out.end_time = time.perf_counter()
    out.success = not out.error
    out.latency = last - st
    out.generated_text = "".join(text)
    return out


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------
def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def calculate_metrics(outputs: list[RequestOutput], duration_s: float,
                      percentiles=(90, 99)) -> dict:
    """vLLM calculate_metrics. TPOT per request = (E2EL - TTFT) / (output_tokens - 1), only for
    output_tokens > 1; ITLs pooled over requests; percentiles by numpy linear interpolation; an
    empty list reads as 0. Throughputs divide by duration (first send to last finish)."""
    ttfts, tpots, itls, e2els, out_lens = [], [], [], [], []
    total_input = 0
    for o in outputs:
        if not o.success:
            continue
        n = o.output_tokens
        out_lens.append(n)
        total_input += o.prompt_len
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        itls.extend(o.itl)
        if n > 1:
            tpots.append((o.latency - o.ttft) / (n - 1))
    completed = len(out_lens)
    total_output = int(sum(out_lens))
    dur = duration_s if duration_s > 0 else float("nan")
    m: dict = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": int(total_input),
        "total_output_tokens": total_output,
        "request_throughput": completed / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
    }
    for name, vals in zip(METRICS, (ttfts, tpots, itls, e2els)):
        arr = np.asarray(vals or [0.0], dtype=np.float64) * 1000.0
        m[f"mean_{name}_ms"] = float(np.mean(arr))
        m[f"median_{name}_ms"] = float(np.median(arr))
        m[f"std_{name}_ms"] = float(np.std(arr))
        for p in percentiles:
            m[f"p{_pname(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return m


def print_summary(m: dict, max_concurrency, percentiles=(90, 99), file=sys.stdout) -> None:
    def row(k, v, fmt="{:<10}"):
        if not isinstance(v, (int, float)):
            fmt, v = "{:<10}", str(v)
        print(("{:<40} " + fmt).format(k, v), file=file)

    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="), file=file)
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Maximum request concurrency:", max_concurrency)
    row("Request rate (req/s):", m.get("request_rate", "inf"))
    row("Benchmark duration (s):", m["duration"], "{:<10.2f}")
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"], "{:<10.2f}")
    row("Output token throughput (tok/s):", m["output_throughput"], "{:<10.2f}")
    row("Total Token throughput (tok/s):", m["total_token_throughput"], "{:<10.2f}")
    for name in METRICS:
        title, short = METRIC_TITLES[name]
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"), file=file)
        row(f"Mean {short} (ms):", m[f"mean_{name}_ms"], "{:<10.2f}")
        row(f"Median {short} (ms):", m[f"median_{name}_ms"], "{:<10.2f}")
        for p in percentiles:
            row(f"P{_pname(p)} {short} (ms):", m[f"p{_pname(p)}_{name}_ms"], "{:<10.2f}")
    print("=" * 50, file=file, flush=True)


# ---------------------------------------------------------------------------------------------
# Run
# ---------------------------------------------------------------------------------------------
def _raise_nofile_limit() -> None:
    """One socket per in-flight request: lift the soft open-files limit to the hard one."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY
                                                        else max(soft, 65536), hard))
    except (ImportError, ValueError, OSError):
        pass


async def _discover_model(client, base_url: str) -> str | None:
    try:
        r = await client.get(base_url.rstrip("/") + "/v1/models", timeout=5.0)
        if r.status_code == 200:
            data = r.json().get("data") or []
            if data and data[0].get("id"):
                return str(data[0]["id"])
    except Exception:  # noqa: BLE001
        pass
    return None


async def _scrape_metrics(client, base_url: str) -> dict[str, float]:
    """Unlabelled sums of a Prometheus /metrics page (`_total` dropped); {} when there is none."""
    try:
        r = await client.get(base_url.rstrip("/") + "/metrics", timeout=5.0)
        if r.status_code != 200:
            return {}
    except Exception:  # not every server has /metrics
        return {}
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        try:
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0].removesuffix("_total")
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def benchmark(*, base_url: str, requests: list[SampleRequest], model: str | None = None,
                    endpoint: str = "/v1/completions", request_rate: float = math.inf,
                    burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                    duration: float | None = None, ignore_eos: bool = True,
                    temperature: float = 0.0, request_timeout: float = 600.0,
                    initial_test: bool = True, percentiles=(90, 99), tokenizer=None,
                    extra_body: dict | None = None, progress: bool = True) -> tuple[dict, list]:
    """Run one benchmark point; returns (metrics, outputs).

    Open loop: requests[i] is sent at arrival_offsets(...)[i]; with max_concurrency the request
    waits for a slot first and its timer starts only once it holds one. Closed loop (duration set
    and request_rate inf): max_concurrency slots kept busy, cycling through `requests`, with no
    new sends after `duration` seconds."""
    import httpx

    if not requests:
        raise ValueError("no requests")
    _raise_nofile_limit()
    closed_loop = duration is not None and math.isinf(request_rate)
    if closed_loop and not max_concurrency:
        raise ValueError("--duration with --request-rate inf needs --max-concurrency")
    conns = (max_concurrency + 4) if max_concurrency else max(len(requests) + 4, 64)
    limits = httpx.Limits(max_connections=conns, max_keepalive_connections=conns)
    timeout = httpx.Timeout(connect=30.0, read=request_timeout, write=30.0, pool=request_timeout)
    url = base_url.rstrip("/") + endpoint
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        if not model:
            model = await _discover_model(client, base_url) or "default"

        def send(req):
            return send_request(client, url, model, req, ignore_eos=ignore_eos,
                                temperature=temperature, timeout_s=request_timeout,
                                extra_body=extra_body)

        if initial_test:
            t = await send(requests[0])
            if not t.success:
                raise RuntimeError(f"initial test request failed: {t.error}")
        metrics0 = await _scrape_metrics(client, base_url)

        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        done = 0

        async def run_one(req, holds_slot: bool):
            nonlocal done
            try:
                if sem is not None and not holds_slot:
                    async with sem:
                        return await send(req)
                return await send(req)
            finally:
                if holds_slot:
                    sem.release()
                done += 1

        async def report():
            while True:
                await asyncio.sleep(10.0)
                print(f"  ... {done}/{len(tasks)} requests finished", file=sys.stderr, flush=True)

        tasks: list[asyncio.Task] = []
        reporter = asyncio.create_task(report()) if progress else None
        offsets = None if closed_loop else arrival_offsets(len(requests), request_rate, burstiness, seed)
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        i = 0
        while True:
            if closed_loop:
                if time.perf_counter() - t0 >= duration:
                    break
                await sem.acquire()
                if time.perf_counter() - t0 >= duration:
                    sem.release()
                    break
                tasks.append(asyncio.create_task(run_one(requests[i % len(requests)], True)))
            else:
                if i >= len(requests):
                    break
                delay = t0 + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(run_one(requests[i], False)))
            i += 1
        outputs: list[RequestOutput] = list(await asyncio.gather(*tasks))
        metrics1 = await _scrape_metrics(client, base_url)
        # Client CPU over the run: near 1.0 means the (single-threaded) client, not the server,
        # may be what limits the measured ITL / throughput.
        client_cpu = (time.process_time() - cpu0) / max(time.perf_counter() - t0, 1e-9)
        if reporter:
            reporter.cancel()
    if not outputs:
        raise RuntimeError("no request was sent")

    for o in outputs:  # vLLM falls back to counting generated text when usage is missing
        if o.success and not o.output_tokens:
            o.output_tokens = (len(tokenizer.encode(o.generated_text, add_special_tokens=False).ids)
                               if tokenizer is not None else o.chunks)
    dur = max(o.end_time for o in outputs) - min(o.start_time for o in outputs)
    m = calculate_metrics(outputs, dur, percentiles)
    # The rate requests actually went out at (a Poisson sample of 60 requests is +-13% off the
    # nominal rate); the sweep compares the achieved request throughput against it.
    send_span = max(o.start_time for o in outputs) - min(o.start_time for o in outputs)
    m["client_cpu_util"] = round(client_cpu, 3)
    if client_cpu > 0.8:
        print(f"warning: client CPU {client_cpu:.0%} of one core; latencies may be client-bound",
              file=sys.stderr)
    m["send_duration"] = send_span
    m["realized_request_rate"] = ((len(outputs) - 1) / send_span if len(outputs) > 1 and send_span > 0
                                  else request_rate)
    # What a server that keeps up would achieve on this sample: N / (send span + fastest E2EL).
    # Saturation shows as achieved request_throughput well below it (the backlog drains late).
    ok_lat = [o.latency for o in outputs if o.success]
    m["keepup_request_rate"] = (len(outputs) / (send_span + min(ok_lat))
                                if ok_lat and send_span + min(ok_lat) > 0 else request_rate)
    # openinfer servers only: the share of the engine loop's busy time the GPU was computing.
    busy = metrics1.get("openinfer_engine_busy_seconds", 0.0) - metrics0.get("openinfer_engine_busy_seconds", 0.0)
    if busy > 0:
        gpu = metrics1.get("openinfer_step_gpu_seconds", 0.0) - metrics0.get("openinfer_step_gpu_seconds", 0.0)
        m["server_gpu_busy_fraction"] = round(gpu / busy, 4)
        m["server_engine_steps"] = (metrics1.get("openinfer_engine_steps", 0.0)
                                    - metrics0.get("openinfer_engine_steps", 0.0))
        # Prompt tokens served from the prefix cache: a sweep's points send the same seeded prompts,
        # so a server kept warm across points skips most prefills (run_serving_bench.sh restarts it).
        m["server_prefix_cache_hit_tokens"] = (metrics1.get("openinfer_prefix_cache_hit_tokens", 0.0)
                                               - metrics0.get("openinfer_prefix_cache_hit_tokens", 0.0))
    m.update(model_id=model, num_requests_sent=len(outputs),
             prompts_reused=max(0, len(outputs) - len(requests)), request_rate=request_rate,
             burstiness=burstiness, max_concurrency=max_concurrency)
    errs: dict[str, int] = {}
    for o in outputs:
        if o.error:
            errs[o.error] = errs.get(o.error, 0) + 1
    m["errors"] = dict(sorted(errs.items(), key=lambda kv: -kv[1])[:20])
    return m, outputs


# ---------------------------------------------------------------------------------------------
# Provenance
# ---------------------------------------------------------------------------------------------
def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT)
        return r.stdout.strip() if r.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def machine_info() -> dict:
    gpus = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                 "--format=csv,noheader"])
    return {
        "hostname": socket.gethostname(),
        "gpus": gpus.splitlines() if gpus else [],
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def git_info() -> dict:
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"])
    return {"commit": _run(["git", "rev-parse", "HEAD"]) or "unknown",
            "dirty": bool(status) if status is not None else None}


def provenance() -> dict:
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join([sys.executable] + sys.argv),
        "machine": machine_info(),
        "git": git_info(),
    }


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="default http://HOST:PORT")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--endpoint", default="/v1/completions")
    ap.add_argument("--model", default=None,
                    help="model name sent in requests (default: first id of /v1/models)")
    ap.add_argument("--model-path", default=None, help="model dir (for its tokenizer.json)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json or a dir holding one")
    ap.add_argument("--dataset-name", default="random", choices=["random", "multiturn"],
                    help="random (vLLM's), or multiturn: --num-conversations chats of --turns turns, each turn "
                         "--random-input-len new tokens after the last prompt and a --random-output-len stand-in "
                         "reply, at most --max-concurrency turns in flight")
    ap.add_argument("--num-conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--random-prefix-len", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=None,
                    help="seconds: finite rate -> num_prompts = ceil(rate*duration); rate inf -> "
                         "keep --max-concurrency busy for this long (cycling --num-prompts prompts)")
    ap.add_argument("--request-rate", type=float, default=math.inf)
    ap.add_argument("--burstiness", type=float, default=1.0)
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ap.add_argument("--metric-percentiles", default="90,99")
    ap.add_argument("--skip-initial-test", action="store_true")
    ap.add_argument("--wait-health", type=float, default=0.0,
                    help="wait up to this many seconds for GET /health == 200 first")
    ap.add_argument("--result-json", default=None)
    ap.add_argument("--save-detailed", action="store_true",
                    help="also store per-request lengths, ttfts, e2els, itls, errors")
    ap.add_argument("--label", default=None)
    ap.add_argument("--no-progress", action="store_true")
    return ap


def wait_health(base_url: str, timeout_s: float, proc=None) -> float | None:
    """Poll GET /health until 200. Returns seconds waited, or None on timeout / process exit."""
    import httpx

    t0 = time.perf_counter()
    with httpx.Client(timeout=2.0, trust_env=False) as c:
        while time.perf_counter() - t0 < timeout_s:
            if proc is not None and proc.poll() is not None:
                return None
            try:
                if c.get(base_url.rstrip("/") + "/health").status_code == 200:
                    return time.perf_counter() - t0
            except Exception:  # noqa: BLE001
                pass
            time.sleep(0.05)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if args.duration is not None and not math.isinf(args.request_rate):
        args.num_prompts = max(1, math.ceil(args.request_rate * args.duration))
    if args.wait_health > 0 and wait_health(base_url, args.wait_health) is None:
        print(f"server at {base_url} not healthy after {args.wait_health} s", file=sys.stderr)
        return 2
    tok = load_tokenizer(args.model_path, args.tokenizer)
    if args.dataset_name == "multiturn":
        convs = multiturn_conversations(tok, args.num_conversations, args.turns, args.random_input_len,
                                        args.random_output_len, args.seed)
        m, _ = asyncio.run(benchmark_multiturn(base_url=base_url, conversations=convs,
                                               max_concurrency=args.max_concurrency or 8, model=args.model,
                                               endpoint=args.endpoint, request_timeout=args.request_timeout,
                                               percentiles=percentiles))
        print_summary(m, args.max_concurrency, percentiles)
        print(f"prefix hit rate {m['prefix_hit_rate']:.3f} (GPU {m['server_gpu_hit_tokens']:.0f} + host "
              f"{m['server_host_hit_tokens']:.0f} of {m['server_prompt_tokens']:.0f} prompt tokens)")
        if args.result_json:
            Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.result_json).write_text(json.dumps({"label": args.label, **provenance(), "args": vars(args),
                                                          **m}, indent=2, default=str) + "\n")
        return 0 if m["completed"] else 1
    t = time.perf_counter()
    reqs = sample_random_requests(tok, args.num_prompts, args.random_input_len,
                                  args.random_output_len, args.seed, args.random_range_ratio,
                                  args.random_prefix_len)
    print(f"dataset: {len(reqs)} prompts, {sum(r.prompt_len for r in reqs)} input tokens "
          f"({time.perf_counter() - t:.1f} s)", file=sys.stderr, flush=True)
    try:
        m, outputs = asyncio.run(benchmark(
            base_url=base_url, requests=reqs, model=args.model, endpoint=args.endpoint,
            request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, seed=args.seed, duration=args.duration,
            ignore_eos=args.ignore_eos, temperature=args.temperature,
            request_timeout=args.request_timeout, initial_test=not args.skip_initial_test,
            percentiles=percentiles, tokenizer=tok, progress=not args.no_progress))
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print_summary(m, args.max_concurrency, percentiles)
    if args.result_json:
        res = {"backend": "openai", "endpoint_type": "openai", "label": args.label,
               **provenance(), "args": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                                        for k, v in vars(args).items()},
               "base_url": base_url, "tokenizer_file": str(find_tokenizer_file(args.model_path,
                                                                               args.tokenizer)),
               **{k: ("inf" if isinstance(v, float) and math.isinf(v) else v) for k, v in m.items()}}
        if args.save_detailed:
            res.update(input_lens=[o.prompt_len for o in outputs],
                       output_lens=[o.output_tokens for o in outputs],
                       ttfts=[o.ttft for o in outputs], e2els=[o.latency for o in outputs],
                       itls=[o.itl for o in outputs], req_errors=[o.error for o in outputs])
        p = Path(args.result_json)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {p}", file=sys.stderr)
    return 0 if m["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
