"""`openinfer-serve` as a user runs it (a subprocess): flags, refusals in one line before anything loads,
--version, and a real server process on the tiny checkpoint (CPU)."""

import argparse
import dataclasses
import re
import signal
import socket
import subprocess
import time
from types import SimpleNamespace

import httpx
import pytest

from cli_util import one_line, run
from gpu_util import NO_GPU
from openinfer import __version__
from openinfer.cli import build_parser, engine_config, main, server_config
from openinfer.config import EngineConfig, EngineUnavailable, ServerConfig

FLAGS = ["--model-path", "--host", "--port", "--served-model-name", "--gpu-memory-utilization",
         "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--cuda-graph", "--overlap-steps",
         "--pdl", "--no-prefix-cache", "--enable-prefix-caching", "--kv-offload", "--kv-offload-host-gib",
         "--dflash-draft-model-path", "--num-kv-blocks", "--persistent-decode", "--max-waiting-requests",
         "--api-key", "--log-level", "--device", "--load-format", "--version"]
FAST_S = 1.0  # a refusal that needs no weights: well under the 2+ s the tiny model takes to load


def serve(env, *args):
    return run(env, "openinfer-serve", *args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, cli_env):
    out = tmp_path_factory.mktemp("cli") / "tiny-model"
    r, _ = run(cli_env, "python", "-m", "openinfer.tools.random_checkpoint", "--preset", "tiny", "--out", str(out),
               timeout=120)
    assert r.returncode == 0, r.stderr
    return str(out)


def test_help_explains_every_flag(cli_env):
    r, _ = serve(cli_env, "--help")
    assert r.returncode == 0
    for flag in FLAGS:
        assert flag in r.stdout, flag
    for action in build_parser()._actions:  # every flag has its own help text
        assert action.help, action.option_strings


def test_flags_are_the_config_fields():
    """Every option of EngineConfig and ServerConfig is a flag (its dest is the field), with the field's
    help text and its one default shown once."""
    actions = {a.dest: a for a in build_parser()._actions
               if a.option_strings and a.dest != "help" and not isinstance(a, argparse._StoreConstAction)}
    for cls in (EngineConfig, ServerConfig):
        for f in dataclasses.fields(cls):
            if not f.init or f.metadata.get("hidden"):
                continue
            assert f.name in actions, f.name
            assert actions[f.name].help.startswith(f.metadata["help"]), f.name
            assert actions[f.name].help.count("(default:") <= 1, f.name


def test_draft_model_refusals_name_the_flags(cli_env, tiny):
    r, _ = serve(cli_env, "--model-path", tiny, "--device", "cpu", "--dflash-draft-model-path", "models/draft")
    assert r.returncode == 2 and "--dflash-draft-model-path 'models/draft' has no config.json" in r.stderr
    r, _ = serve(cli_env, "--model-path", tiny, "--dflash-draft-model-path", "models/draft")  # the CUDA engine's too
    assert r.returncode == 2 and "--dflash-draft-model-path 'models/draft' has no config.json" in r.stderr


# what the command says of itself: its engine is the one on its path (src/ has none unless one was put there)
VERSION_LINE = re.compile(rf"openinfer {re.escape(__version__)} \(CUDA engine (not built: --device cpu only|"
                          r"for sm_\w+(, sm_\w+)*, commit \S+)\)")


def test_version_without_gpu_or_engine(cli_env):
    r, dt = serve(cli_env, "--version")
    assert r.returncode == 0 and VERSION_LINE.fullmatch(r.stdout.strip()) and dt < FAST_S, (r.stdout, dt)


@pytest.mark.parametrize("args,needle", [
    (["--port", "99999"], "--port must be an integer in [0, 65535], got 99999"),
    (["--port", "abc"], "argument --port: invalid int value: 'abc' (see openinfer-serve --help)"),
    (["--host", "192.0.2.1"], "cannot listen on 192.0.2.1:8000: "),  # TEST-NET: no interface has it
    (["--max-body-mib", "0"], "--max-body-mib must be a positive number, got 0.0"),
    (["--kv-offload-host-gib", "4"], "--kv-offload-host-gib needs --kv-offload"),
    (["--kv-offload"], "--kv-offload needs --kv-offload-host-gib"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be a positive integer"),
    (["--dflash-draft-model-path", "models/draft"], "--dflash-draft-model-path 'models/draft' has no config.json"),
])
def test_refusals_are_one_line_before_the_model_loads(cli_env, tiny, args, needle):
    r, dt = serve(cli_env, "--model-path", tiny, "--device", "cpu", *args)
    assert r.returncode == 2 and needle in one_line(r.stderr) and dt < FAST_S, (r.stderr, dt)


def test_port_in_use_is_refused_before_the_model_loads(cli_env, tiny):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r, dt = serve(cli_env, "--model-path", tiny, "--device", "cpu", "--port", str(port))
    assert r.returncode == 2 and dt < FAST_S, (r.stderr, dt)
    assert one_line(r.stderr) == f"openinfer-serve: cannot listen on 127.0.0.1:{port}: Address already in use"


def test_model_path_messages(cli_env, tiny, tmp_path):
    nope = tmp_path / "nope"
    for args, line in [
            ([str(nope)], f"model directory '{nope}' does not exist; download one, e.g. `hf download Qwen/Qwen3-4B "
                          f"--local-dir models/Qwen3-4B`, or write a random-weight one with `python -m "
                          f"openinfer.tools.random_checkpoint --out {nope} --preset qwen3-4b`"),
            ([str(nope), "--device", "cpu"], f"model directory '{nope}' does not exist; write a tiny random-weight "
                                             "one for the CPU backend with `python -m openinfer.tools.random_checkpoint"
                                             f" --out {nope} --preset tiny`"),
            ([tiny + "/config.json"], f"'{tiny}/config.json' is a file, not a model directory; its directory is "
                                      f"'{tiny}'")]:
        r, dt = serve(cli_env, "--model-path", *args)
        assert r.returncode == 2 and one_line(r.stderr) == "openinfer-serve: " + line and dt < FAST_S, (r.stderr, dt)


def test_cuda_without_its_engine_or_a_gpu_speaks_flags(cli_env, tiny):
    """--device cuda where the command finds no engine (src/ has none unless one was put there) or no GPU."""
    if NO_GPU is None:
        pytest.skip("a GPU is visible here: --device cuda would start the engine")
    r, dt = serve(cli_env, "--model-path", tiny)
    line = one_line(r.stderr)
    assert r.returncode == 1 and dt < FAST_S, (line, dt)
    assert "without its CUDA engine" in line or "no CUDA GPU was found" in line
    assert "--device cpu" in line and 'device="cpu"' not in line


def test_no_gpu_says_so_in_each_language(monkeypatch, capsys, tiny):
    """The same refusal, as the command line and as the Python API write it."""
    no_gpu = SimpleNamespace(device_count=lambda: 0)
    monkeypatch.setattr("openinfer.version._engine_or_why", lambda: (no_gpu, None))
    assert main(["--model-path", tiny, "--port", "0"]) == 1
    assert one_line(capsys.readouterr().err) == (
        "openinfer-serve: cannot start the engine: no CUDA GPU was found; --device cpu runs small models on the "
        "NumPy reference backend")
    from openinfer import Engine
    with pytest.raises(EngineUnavailable) as e:
        Engine(tiny)
    assert str(e.value) == 'no CUDA GPU was found; device="cpu" runs small models on the NumPy reference backend'


def test_api_key_from_the_environment(monkeypatch, tiny):
    monkeypatch.delenv("OPENINFER_API_KEY", raising=False)
    assert ServerConfig().api_key is None
    monkeypatch.setenv("OPENINFER_API_KEY", "from-env")
    assert ServerConfig().api_key == "from-env"
    flag = server_config(build_parser().parse_args(["--model-path", tiny, "--api-key", "from-flag"]))
    assert flag.api_key == "from-flag"  # the flag wins


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


def test_server_process_serves_and_stops(cli_env, tiny):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen(["openinfer-serve", "--model-path", tiny, "--device", "cpu", "--port", str(port),
                          "--max-model-len", "256", "--served-model-name", "tiny-x"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(cli_env, OPENINFER_API_KEY="k"),
                         # as from a terminal: a suite started in the background would pass SIGINT ignored
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
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
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401  # the key came from the environment
        h = {"Authorization": "Bearer k"}
        assert httpx.get(url + "/v1/models", headers=h, timeout=10).json()["data"][0]["id"] == "tiny-x"
        r = httpx.post(url + "/v1/completions", headers=h, timeout=60,
                       json={"model": "tiny-x", "prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        version = httpx.get(url + "/version", timeout=10).json()
        assert version["version"] == __version__ and "engine" in version
        index = httpx.get(url + "/", timeout=10).json()
        assert index["version"] == __version__ and "POST /v1/chat/completions" in index["routes"]
    finally:
        p.send_signal(signal.SIGINT)
        try:
            out, _ = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
    assert VERSION_LINE.search(out) and "ready" in out and "after start" in out
    assert p.returncode == 130 and "Traceback" not in out, out  # Ctrl-C: a clean stop
