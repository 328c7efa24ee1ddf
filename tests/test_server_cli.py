"""`openinfer-serve`: flags, refusals, and a real server process on the tiny checkpoint (CPU)."""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from openinfer.cli import build_parser, engine_config

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
FLAGS = ["--model-path", "--host", "--port", "--served-model-name", "--gpu-memory-utilization",
         "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--cuda-graph", "--overlap-steps",
         "--pdl", "--no-prefix-cache", "--enable-prefix-caching", "--kv-offload", "--kv-offload-host-gib",
         "--dflash-draft-model-path", "--num-kv-blocks", "--persistent-decode", "--max-waiting-requests",
         "--api-key", "--log-level", "--device", "--load-format"]


def cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "openinfer.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny-model"
    subprocess.run([sys.executable, "-m", "openinfer.tools.random_checkpoint", "--preset", "tiny",
                    "--out", str(out)], check=True, timeout=120, capture_output=True, env=ENV)
    return str(out)


def test_help_explains_every_flag():
    r = cli("--help")
    assert r.returncode == 0
    for flag in FLAGS:
        assert flag in r.stdout, flag
    for action in build_parser()._actions:  # every flag has its own help text
        assert action.help, action.option_strings


def test_flags_are_the_config_fields():
    """Every option of EngineConfig and ServerConfig is a flag (its dest is the field), with the field's
    help text and its one default shown once."""
    import dataclasses

    from openinfer.config import EngineConfig, ServerConfig
    actions = {a.dest: a for a in build_parser()._actions
               if a.option_strings and a.dest != "help" and not isinstance(a, argparse._StoreConstAction)}
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            if not f.init or f.metadata.get("hidden"):
                continue
            assert f.name in actions, f.name
            assert actions[f.name].help.startswith(f.metadata["help"]), f.name
            assert actions[f.name].help.count("(default:") <= 1, f.name


def test_draft_model_refusals_name_the_flags(tiny):
    r = cli("--model-path", tiny, "--device", "cpu", "--dflash-draft-model-path", "models/draft")
    assert r.returncode == 2 and "--dflash-draft-model-path 'models/draft' has no config.json" in r.stderr
    r = cli("--model-path", tiny, "--dflash-draft-model-path", "models/draft")  # the CUDA drafter is not built
    assert r.returncode == 2 and "CPU backend only so far (--device cpu)" in r.stderr


@pytest.mark.parametrize("args,needle", [(["--kv-offload-host-gib", "4"], "--kv-offload-host-gib needs --kv-offload"),
                                         (["--kv-offload"], "--kv-offload needs --kv-offload-host-gib"),
                                         (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer")])
def test_bad_options_name_the_flags(tiny, args, needle):
    r = cli("--model-path", tiny, "--device", "cpu", *args)
    assert r.returncode == 2 and needle in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_model_dir_one_clear_message(tmp_path):
    r = cli("--model-path", str(tmp_path / "nope"))
    assert r.returncode != 0
    assert "huggingface-cli download Qwen/Qwen3-4B --local-dir models/Qwen3-4B" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_flags_map_to_engine_config(tiny):
    a = build_parser().parse_args(["--model-path", tiny, "--device", "cpu", "--cuda-graph", "false",
                                   "--overlap-steps", "false", "--pdl", "false", "--gemm-autotune", "false", "--no-prefix-cache", "--max-model-len", "300",
                                   "--max-num-seqs", "8", "--max-num-batched-tokens", "64"])
    c = engine_config(a)
    assert (c.cuda_graph, c.overlap_steps, c.pdl, c.gemm_autotune, c.enable_prefix_caching, c.max_model_len,
            c.max_num_seqs, c.max_num_batched_tokens, c.device) == (False, False, False, False, False, 300, 8, 64, "cpu")
    d = engine_config(build_parser().parse_args(["--model-path", tiny]))
    assert d.cuda_graph and d.overlap_steps and d.pdl and d.gemm_autotune and d.enable_prefix_caching
    assert d.device == "cuda"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cuda-graph", "maybe"])


def test_server_process_serves_and_stops(tiny):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "openinfer.cli", "--model-path", tiny,
                          "--device", "cpu", "--port", str(port), "--max-model-len", "256",
                          "--api-key", "k", "--served-model-name", "tiny-x"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "server did not become healthy"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        h = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/v1/models", headers=h, timeout=10).json()["data"][0]["id"] == "tiny-x"
        r = httpx.post(url + "/v1/completions", headers=h, timeout=60,
                       json={"model": "tiny-x", "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        p.send_signal(signal.SIGINT)
        try:
            out, _ = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
    assert "ready" in out and "after start" in out
