"""Helpers shared by the server test modules (no tests here): a uvicorn server on 127.0.0.1 in a
background thread, bound to a free port."""

import socket
import threading
import time

import httpx
import uvicorn

from openinfer.server import build_app


class RunningServer:
    def __init__(self, engine, **app_kw):
        self.app = build_app(engine, **app_kw)
        self.state = self.app.state.openinfer
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # as cli.listen_socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                     timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def stop(self):
        self._server.should_exit = True
        self._thread.join(10)


def metric(url: str, name: str) -> float:
    """One sample of the Prometheus text at /metrics (labels ignored; first match)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_until(pred, timeout=15.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()
