"""The README's "Quickstart (CPU)" run as written, so that it cannot drift from the code.

Its fenced blocks are taken from README.md: the bash block runs as one script (the server it starts
in the background included), then the python block, then the server is stopped. Two departures,
both forced: the install line (a command that starts with `pip install`, after any VAR=value) is
skipped, because the package is already installed where the tests run; and the commands run in a
temporary directory, so that `models/tiny` does not land in the checkout. Like the other command
tests they run with this checkout's src/ on PYTHONPATH (tests/cli_util.py).
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from cli_util import ROOT

SECTION = "## Quickstart (CPU)"
INSTALL = re.compile(r"^(\w+=\S*\s+)*pip install\b")
PORT = 8000  # the server's default, which the quickstart relies on


def quickstart_blocks() -> list[tuple[str, str]]:
    """(language, code) of each fenced block of the section, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION + "\n")
    end = text.find("\n## ", start + len(SECTION))
    section = text[start:end if end >= 0 else None]
    return re.findall(r"^```(\w+)\n(.*?)^```$", section, re.S | re.M)


def without_install(script: str) -> str:
    lines = script.replace("\\\n", " ").splitlines()  # continued lines are one command
    return "\n".join(line for line in lines if not INSTALL.match(line.strip()))


def port_taken() -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", PORT))
        except OSError:
            return True
    return False


def stop_group(pgid: int, timeout: float = 20) -> None:
    """SIGTERM to the script's process group (the server it left running), then wait for it to end."""
    try:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_blocks_are_there():
    blocks = quickstart_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "python"]
    bash = blocks[0][1]
    assert INSTALL.match(bash.splitlines()[0]) and "OPENINFER_CUDA=0" in bash.splitlines()[0]
    assert "openinfer-serve" in bash and "curl" in bash and "from openai import OpenAI" in blocks[1][1]


def test_quickstart_runs_verbatim(cli_env, tmp_path):
    if shutil.which("curl") is None:
        pytest.skip("the quickstart uses curl, which this machine lacks")
    if port_taken():
        pytest.skip(f"port {PORT}, which the quickstart serves on, is taken here")
    (_, bash), (_, python) = quickstart_blocks()
    log = tmp_path / "quickstart.log"
    t0 = time.perf_counter()
    with open(log, "w") as out:
        p = subprocess.Popen(["bash", "-e", "-c", without_install(bash)], cwd=tmp_path, env=cli_env,
                             stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = p.wait(timeout=120)
        assert rc == 0, log.read_text()
        assert '"object":"text_completion"' in log.read_text(), log.read_text()
        r = subprocess.run([sys.executable, "-"], input=python, cwd=tmp_path, env=cli_env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr + log.read_text()
    finally:
        stop_group(p.pid)
    print(f"quickstart: {time.perf_counter() - t0:.1f} s")
