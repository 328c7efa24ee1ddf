#!/usr/bin/env python3
"""Footprint of openinfer-serve: startup to HTTP ready, RSS loaded / idle / after a stress run,
GPU memory in use.

    python3 bench/footprint.py MODEL_DIR [--server-args "--foo 1"] [--json bench/results/x.json]

The server starts as a cold process (page cache warmed first by reading the model files, unless
--no-warm-page-cache); startup = spawn to the first 200 from GET /health. RSS is summed over the
server process and its children (psutil if present, else /proc/PID/status VmRSS).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402


def _children_proc(pid: int) -> list[int]:
    """All descendants of pid, from /proc/*/stat parent links."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def process_tree(pid: int) -> list[int]:
    try:
        import psutil

        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except ImportError:
        return [pid] + _children_proc(pid)
    except Exception:  # noqa: BLE001 - process gone
        return [pid]


def rss_bytes(pid: int) -> int:
    """RSS of pid and all its descendants, in bytes."""
    try:
        import psutil
    except ImportError:
        psutil = None
    total = 0
    for p in process_tree(pid):
        try:
            if psutil is not None:
                total += psutil.Process(p).memory_info().rss
                continue
            with open(f"/proc/{p}/status") as f:
                total += next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:")), 0)
        except Exception:  # noqa: BLE001 - process gone
            pass
    return total


def gpu_memory(pid: int) -> dict:
    """MiB used by our processes (compute-apps), plus the per-GPU total in use."""
    res: dict = {}
    pids = set(process_tree(pid))
    try:
        r = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=15)
        if r.returncode == 0:
            ours = [int(u) for p, u in (ln.split(",") for ln in r.stdout.strip().splitlines()
                                        if ln.count(",") == 1) if int(p) in pids]
            res["process_used_mib"] = sum(ours) if ours else None  # None: pids hidden (container)
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.total",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=15)
        if r.returncode == 0:
            res["gpus"] = [dict(zip(("index", "used_mib", "total_mib"), map(int, ln.split(","))))
                           for ln in r.stdout.strip().splitlines() if ln.count(",") == 2]
    except (OSError, subprocess.TimeoutExpired, ValueError):
        pass
    return res


def warm_page_cache(model_dir: Path, limit_s: float = 300.0) -> float:
    t0 = time.perf_counter()
    for p in sorted(model_dir.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(64 << 20):
                    if time.perf_counter() - t0 > limit_s:
                        return time.perf_counter() - t0
    return time.perf_counter() - t0


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own session, started by us
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--server-args", default="", help="extra openinfer-serve args, one string")
    ap.add_argument("--server-cmd", default="openinfer-serve")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--idle-seconds", type=float, default=5.0, help="wait before 'idle' RSS")
    ap.add_argument("--stress-requests", type=int, default=200)
    ap.add_argument("--stress-concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--no-warm-page-cache", action="store_true")
    ap.add_argument("--json", default=None, help="result path (default: print only)")
    ap.add_argument("--log", default=None, help="server log (default: next to --json or /tmp)")
    args = ap.parse_args(argv)

    model_dir = Path(args.model_dir)
    base_url = f"http://127.0.0.1:{args.port}"
    res: dict = {**sb.provenance(), "model_dir": str(model_dir), "server_args": args.server_args,
                 "args": vars(args)}
    tok = sb.load_tokenizer(str(model_dir))
    reqs = sb.sample_random_requests(tok, args.stress_requests, args.input_len, args.output_len,
                                     args.seed)
    if not args.no_warm_page_cache:
        res["page_cache_warm_s"] = round(warm_page_cache(model_dir), 2)

    if sb.wait_health(base_url, 1.0) is not None:
        print(f"something already answers on port {args.port}; stop it or pass --port",
              file=sys.stderr)
        return 1
    log_path = Path(args.log or (Path(args.json).with_suffix(".server.log") if args.json
                                 else f"/tmp/openinfer-footprint-{os.getpid()}.log"))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = shlex.split(args.server_cmd) + ["--model-path", str(model_dir), "--port",
                                          str(args.port)] + shlex.split(args.server_args)
    res["server_command"] = shlex.join(cmd)
    with open(log_path, "wb") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    rc = 1
    try:
        ready = sb.wait_health(base_url, args.startup_timeout, proc)
        if ready is None:
            res["error"] = (f"server exited with {proc.returncode}" if proc.poll() is not None
                            else f"not healthy after {args.startup_timeout} s")
            print(res["error"], f"(log: {log_path})", file=sys.stderr)
        else:
            res["startup_to_ready_s"] = round(time.perf_counter() - t0, 3)
            res["rss_loaded_mib"] = round(rss_bytes(proc.pid) / 2**20, 1)
            res["gpu_memory_loaded"] = gpu_memory(proc.pid)
            time.sleep(args.idle_seconds)
            res["rss_idle_mib"] = round(rss_bytes(proc.pid) / 2**20, 1)
            m, _ = asyncio.run(sb.benchmark(
                base_url=base_url, requests=reqs, request_rate=math.inf,
                max_concurrency=args.stress_concurrency, seed=args.seed, tokenizer=tok,
                progress=False))
            res["stress"] = {k: m[k] for k in ("completed", "failed", "duration",
                                               "output_throughput", "median_ttft_ms",
                                               "median_tpot_ms", "errors")}
            res["rss_after_stress_mib"] = round(rss_bytes(proc.pid) / 2**20, 1)
            res["gpu_memory_after_stress"] = gpu_memory(proc.pid)
            time.sleep(args.idle_seconds)
            res["rss_idle_after_stress_mib"] = round(rss_bytes(proc.pid) / 2**20, 1)
            rc = 0
    finally:
        stop(proc)
    res["server_log"] = str(log_path)
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
