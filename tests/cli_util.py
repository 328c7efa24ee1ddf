"""The package's commands run as a user runs them, in subprocesses: `openinfer-serve` (the installed
console script; where nothing is installed, a script of the same three lines in front of PATH) and
`python -m ...`, with this checkout's src/ first on PYTHONPATH, so that the code under test is the
checkout's."""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")


def command_env(bin_dir: Path) -> dict:
    """os.environ with src/ on PYTHONPATH and, when `openinfer-serve` is not installed, a console script
    written into bin_dir in front of PATH."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("OPENINFER_API_KEY", None)
    if shutil.which("openinfer-serve") is None:
        script = bin_dir / "openinfer-serve"
        script.write_text(f"#!{sys.executable}\nimport sys\nfrom openinfer.cli import main\nsys.exit(main())\n")
        script.chmod(0o755)
        env["PATH"] = str(bin_dir) + os.pathsep + env["PATH"]
    return env


def run(env: dict, *cmd: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    """(the finished process, its wall time in seconds)."""
    t0 = time.perf_counter()
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return r, time.perf_counter() - t0


def one_line(stderr: str) -> str:
    """The one line a refusal prints (asserting it is one, without a traceback)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


class ServerProcess:
    """`openinfer-serve --device cpu` on a free port in a subprocess (its own interpreter, so a test's
    clients share no GIL with it); `stop()` sends a signal and returns (exit status, output). Its output
    is read as it comes: a full pipe (64 KiB, a minute of access-log lines) would block the server."""

    def __init__(self, env: dict, model_dir, *args: str, extra_env: dict | None = None, timeout: float = 90):
        import signal
        import socket

        import httpx
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            ["openinfer-serve", "--model-path", str(model_dir), "--device", "cpu", "--port", str(self.port), *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(env, **(extra_env or {})),
            # as from a terminal: a suite started in the background would pass SIGINT ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self._out: list[str] = []
        self._reader = threading.Thread(target=lambda: self._out.extend(self.proc.stdout), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self._reader.join(10)
                raise RuntimeError("server exited: " + "".join(self._out))
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("server did not become healthy")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def wait(self, timeout: float) -> tuple[int, str]:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._reader.join(10)
            raise AssertionError("server did not exit in time: " + "".join(self._out)) from None
        self._reader.join(10)
        return self.proc.returncode, "".join(self._out)

    def stop(self, sig=None, timeout: float = 30) -> tuple[int, str]:
        import signal
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM if sig is None else sig)
        return self.wait(timeout)
