"""The package's commands run as a user runs them, in subprocesses: `openinfer-serve` (the installed
console script; where nothing is installed, a script of the same three lines in front of PATH) and
`python -m ...`, with this checkout's src/ first on PYTHONPATH, so that the code under test is the
checkout's."""
from __future__ import annotations

import os
import shutil
import subprocess
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
