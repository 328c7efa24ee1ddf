"""The host KV tier through the server (Qwen3 random weights, one GPU). Each mode starts its servers
itself (`--server-cmd`, default `python -m openinfer.cli`), one after another, on --port.

  ttft       the seed's table: per input length, cold prefill TTFT, GPU prefix-hit TTFT p50 (prefix cache
             on) and host-restore TTFT p50 (--kv-offload --no-prefix-cache: every hit comes from the host),
             with the pinned host<->device copy rate measured in the same run (torch, when importable) and
             the restores' achieved GB/s (the server's /metrics)
  multiturn  serve_bench.py's multi-turn chats with the GPU pool capped (--num-kv-blocks), with and without
             --kv-offload: prefix-hit rate, TTFT p50/p99
  decode     TPOT of a concurrency-8 decode load alone, beside 16k-token prefixes cycled through a capped GPU
             pool without the tier (recomputed), and with it (written and restored)

  python bench/host_tier_bench.py ttft --model-path DIR --lengths 256,1024,4096,16384 --out ttft.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import serve_bench as sb

MODEL = "bench"  # the servers' --served-model-name


@contextmanager
def server(a, *extra: str, log_name: str = "server"):
    cmd = [*a.server_cmd.split(), "--model-path", a.model_path, "--load-format", a.load_format, "--port",
           str(a.port), "--max-model-len", str(a.max_model_len), "--log-level", "warning", "--served-model-name", MODEL,
           *extra]
    log = open(Path(a.log_dir) / f"{log_name}.log", "w") if a.log_dir else subprocess.DEVNULL
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{a.port}"
    try:
        waited = sb.wait_health(url, 600, proc=p)
        if waited is None:
            raise RuntimeError(f"server did not come up: {' '.join(cmd)}")
        print(f"server up in {waited:.1f} s: {' '.join(extra)}", file=sys.stderr, flush=True)
        yield url
    finally:
        os.killpg(p.pid, 15)
        p.wait(60)


def _prompt(rng, allowed, n: int) -> list[int]:
    return allowed[rng.integers(0, len(allowed), n)].tolist()


async def _ttft(url: str, ids: list[int], max_tokens: int = 1) -> float:
    import httpx

    async with httpx.AsyncClient(timeout=600, trust_env=False) as c:
        o = await sb.send_request(c, url + "/v1/completions", MODEL,
                                  sb.SampleRequest(ids, len(ids), max_tokens))
    if not o.success:
        raise RuntimeError(o.error)
    return o.ttft * 1e3


def _metrics(url: str) -> dict:
    import httpx

    async def get():
        async with httpx.AsyncClient(timeout=10, trust_env=False) as c:
            return await sb._scrape_metrics(c, url)
    return asyncio.run(get())


def pinned_bandwidth() -> dict:
    """The host link's ceiling: one 2 GiB pinned copy each way (torch, a benchmark-only dependency)."""
    try:
        import torch
    except ImportError:
        return {}
    n = 2 << 30
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, fn in (("h2d_gbs", lambda: d.copy_(h, non_blocking=True)), ("d2h_gbs", lambda: h.copy_(d, non_blocking=True))):
        fn()
        torch.cuda.synchronize()
        t = []
        for _ in range(3):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            t.append(e0.elapsed_time(e1) / 1e3)
        out[name] = n / statistics.median(t) / 1e9
    del h, d
    torch.cuda.empty_cache()
    return out


def ttft(a) -> dict:
    tok = sb.load_tokenizer(a.model_path)
    allowed = sb.allowed_token_ids(tok)
    rng = np.random.default_rng(a.seed)
    lengths = [int(x) for x in a.lengths.split(",")]
    prompts = {n: _prompt(rng, allowed, n) for n in lengths}
    rows = {n: {"input_len": n} for n in lengths}
    ceiling = pinned_bandwidth()
    print(f"pinned copy rate: {ceiling}", file=sys.stderr)
    with server(a, "--kv-offload", "--kv-offload-host-gib", str(a.host_gib), log_name="ttft_gpu") as url:
        asyncio.run(_ttft(url, _prompt(rng, allowed, 64)))  # warm-up
        for n in lengths:
            cold = [asyncio.run(_ttft(url, _prompt(rng, allowed, n))) for _ in range(a.cold_reps)]
            asyncio.run(_ttft(url, prompts[n]))  # cached now
            warm = [asyncio.run(_ttft(url, prompts[n])) for _ in range(a.reps)]
            rows[n].update(cold_ttft_ms=statistics.median(cold), gpu_hit_ttft_p50_ms=statistics.median(warm))
            print(json.dumps(rows[n]), file=sys.stderr, flush=True)
    with server(a, "--kv-offload", "--kv-offload-host-gib", str(a.host_gib), "--no-prefix-cache",
                log_name="ttft_host") as url:
        asyncio.run(_ttft(url, _prompt(rng, allowed, 64)))
        for n in lengths:
            asyncio.run(_ttft(url, prompts[n]))  # computed once, saved to the host tier
            time.sleep(0.5)  # its saves land
            m0 = _metrics(url)
            host = []
            for _ in range(a.reps):
                host.append(asyncio.run(_ttft(url, prompts[n])))
                time.sleep(0.2)
            m1 = _metrics(url)
            b = m1.get("openinfer_host_restored_bytes", 0) - m0.get("openinfer_host_restored_bytes", 0)
            s = m1.get("openinfer_host_restore_seconds", 0) - m0.get("openinfer_host_restore_seconds", 0)
            hits = m1.get("openinfer_host_restored_tokens", 0) - m0.get("openinfer_host_restored_tokens", 0)
            r = rows[n]
            r.update(host_restore_ttft_p50_ms=statistics.median(host), restore_gbs=b / s / 1e9 if s else None,
                     restored_tokens_per_request=hits / a.reps, speedup_vs_cold=r["cold_ttft_ms"] / statistics.median(host))
            print(json.dumps(r), file=sys.stderr, flush=True)
    print(f"{'input':>6} {'cold ms':>9} {'GPU hit p50':>11} {'host p50':>9} {'speed-up':>8} {'restore GB/s':>12}")
    for r in rows.values():
        print(f"{r['input_len']:6d} {r['cold_ttft_ms']:9.1f} {r['gpu_hit_ttft_p50_ms']:11.1f} "
              f"{r['host_restore_ttft_p50_ms']:9.1f} {r['speedup_vs_cold']:7.1f}x {r['restore_gbs'] or 0:12.1f}")
    return {"mode": "ttft", "pinned_copy": ceiling, "rows": list(rows.values())}


def multiturn(a) -> dict:
    tok = sb.load_tokenizer(a.model_path)
    convs = sb.multiturn_conversations(tok, a.conversations, a.turns, a.turn_len, a.reply_len, a.seed)
    bs = 16
    distinct = sum(-(-len(c[-1].prompt) // bs) for c in convs)
    out = {"mode": "multiturn", "conversations": a.conversations, "turns": a.turns, "turn_len": a.turn_len,
           "reply_len": a.reply_len, "gpu_kv_blocks": a.num_kv_blocks, "distinct_prefix_blocks": distinct,
           "distinct_over_pool": distinct / a.num_kv_blocks, "runs": {}}
    for name, extra in (("no_offload", ()), ("kv_offload", ("--kv-offload", "--kv-offload-host-gib", str(a.host_gib)))):
        with server(a, "--num-kv-blocks", str(a.num_kv_blocks), *extra, log_name=f"multiturn_{name}") as url:
            m, _ = asyncio.run(sb.benchmark_multiturn(base_url=url, conversations=convs, max_concurrency=a.concurrency))
        out["runs"][name] = m
        print(f"{name}: hit rate {m['prefix_hit_rate']:.3f} (GPU {m['server_gpu_hit_tokens']:.0f}, host "
              f"{m['server_host_hit_tokens']:.0f} of {m['server_prompt_tokens']:.0f}), TTFT p50 "
              f"{m['median_ttft_ms']:.1f} p99 {m['p99_ttft_ms']:.1f} ms, failed {m['failed']}", flush=True)
    return out


def decode(a) -> dict:
    tok = sb.load_tokenizer(a.model_path)
    allowed = sb.allowed_token_ids(tok)
    rng = np.random.default_rng(a.seed)
    fg = sb.sample_random_requests(tok, 64, 256, 512, a.seed)
    long = [_prompt(rng, allowed, 16384) for _ in range(a.long_prompts)]

    async def load(url: str, background: bool, seconds: float) -> dict:
        stop = asyncio.Event()

        async def bg():
            i = 0
            while not stop.is_set():
                await _ttft(url, long[i % len(long)])
                i += 1
                await asyncio.sleep(a.long_gap)

        task = asyncio.create_task(bg()) if background else None
        m, _ = await sb.benchmark(base_url=url, requests=fg, max_concurrency=8, duration=seconds,
                                  initial_test=False, progress=False)
        stop.set()
        if task:
            await task
        return m

    out = {"mode": "decode", "runs": {}}
    cap = ("--num-kv-blocks", str(a.num_kv_blocks))
    for name, extra, background in (("decode_alone", cap, False), ("with_16k_no_offload", cap, True),
                                    ("with_16k_offload", (*cap, "--kv-offload", "--kv-offload-host-gib", str(a.host_gib)), True)):
        with server(a, *extra, log_name=f"decode_{name}") as url:
            asyncio.run(load(url, False, 3))  # warm-up: the foreground load's shapes
            m = asyncio.run(load(url, background, a.seconds))
            mm = _metrics(url)
        out["runs"][name] = dict(m, server_host_restored_tokens=mm.get("openinfer_host_restored_tokens", 0),
                                 server_host_offloaded_blocks=mm.get("openinfer_host_offloaded_blocks", 0))
        print(f"{name}: TPOT p50 {m['median_tpot_ms']:.2f} ms p99 {m['p99_tpot_ms']:.2f}, {m['completed']} requests, "
              f"restored tokens {mm.get('openinfer_host_restored_tokens', 0):.0f}", flush=True)
    r = out["runs"]
    out["tpot_p50_offload_over_no_offload"] = r["with_16k_offload"]["median_tpot_ms"] / r["with_16k_no_offload"]["median_tpot_ms"]
    out["tpot_p50_offload_over_alone"] = r["with_16k_offload"]["median_tpot_ms"] / r["decode_alone"]["median_tpot_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("ttft", "multiturn", "decode"))
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--load-format", default="random")
    ap.add_argument("--server-cmd", default=f"{sys.executable} -m openinfer.cli")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--max-model-len", type=int, default=17000)
    ap.add_argument("--host-gib", type=float, default=24)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--lengths", default="256,512,1024,2048,4096,8192,16384")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cold-reps", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--turn-len", type=int, default=256)
    ap.add_argument("--reply-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-kv-blocks", type=int, default=3300, help="GPU pool cap (multiturn, decode)")
    ap.add_argument("--seconds", type=float, default=30, help="decode: length of the foreground load")
    ap.add_argument("--long-prompts", type=int, default=4, help="decode: distinct 16k prompts cycled")
    ap.add_argument("--long-gap", type=float, default=0.5, help="decode: seconds between 16k requests")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.log_dir:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    res = {"ttft": ttft, "multiturn": multiturn, "decode": decode}[a.mode](a)
    res.update(sb.provenance(), tree=os.environ.get("OPENINFER_TREE", ""))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
