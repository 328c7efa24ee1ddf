"""`openinfer-serve`: the OpenAI-compatible server on one model directory. Its flags are generated from
the fields of EngineConfig and ServerConfig (openinfer.config), help text and defaults included."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import socket
import sys
import time
import types
import typing

from .config import ConfigError, EngineConfig, OptionMessage, ServerConfig

log = logging.getLogger("openinfer")
PROG = "openinfer-serve"
SHUTDOWN_GRACE_S = 5  # after --shutdown-timeout: for the ended requests' last events to go out


def _bool(v: str) -> bool:
    if v.lower() in ("true", "1", "yes", "on"):
        return True
    if v.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def _base_type(annotation) -> type:
    """int for `int | None`, and so on (annotations are strings under `from __future__ import annotations`)."""
    t = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation  # noqa: S307 (our own code)
    if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return t


def flag_of(name: str) -> str:
    """The flag that sets an option (the field name with dashes, unless the field names its flag)."""
    for cls in (EngineConfig, ServerConfig):
        f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
        if f is not None:
            return f.metadata.get("flag", "--" + name.replace("_", "-"))
    return name


def _setting(flag: str, value: str) -> str:
    return f"{flag} {value}"


def cli_text(e: OptionMessage) -> str:
    """The message as the command line speaks: `--max-num-seqs`, `--device cpu`."""
    return e.render(flag_of, _setting)


def _add_options(p: argparse.ArgumentParser, cls) -> None:
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not f.init or meta.get("hidden") or "help" not in meta:
            continue
        t = _base_type(f.type)
        default = f.default
        shown = meta["help"] + ("" if default is None else f" (default: {str(default).lower() if t is bool else default})")
        flag = flag_of(f.name)
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=shown)
        if t is bool:
            kw.update(type=_bool, nargs="?", const=True, metavar="{true,false}")
        else:
            kw.update(type=t, choices=meta.get("choices"),
                      metavar="{" + ",".join(meta["choices"]) + "}" if meta.get("choices")
                      else flag[2:].upper().replace("-", "_"))  # the flag's name, where the field's differs
        if f.name == "model_path":
            kw["required"] = True
        p.add_argument(flag, **kw)
        for alias in meta.get("aliases", ()):  # --no-prefix-cache: the one negative spelling kept
            p.add_argument(alias, dest=f.name, action="store_const", const=not default, default=argparse.SUPPRESS,
                           help=f"the same as {flag_of(f.name)} {str(not default).lower()}")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line: the whole usage would bury it
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and the CUDA engine's build, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from .version import version_line
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG, usage="%(prog)s --model-path MODEL_PATH [options]",
        description="Serve a Qwen3 model directory over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, "
                    "/tokenize, /detokenize, /version).")
    p.add_argument("--version", action=_Version)
    _add_options(p, EngineConfig)
    _add_options(p, ServerConfig)
    return p


def _split(args: argparse.Namespace) -> tuple[dict, dict]:
    given = vars(args)
    names = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
    return ({k: v for k, v in given.items() if k in names}, {k: v for k, v in given.items() if k not in names})


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed flags describe (validated by EngineConfig itself)."""
    return EngineConfig(**_split(args)[0])


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(**_split(args)[1])


def _fail(msg: str, code: int = 2) -> int:
    print(f"{PROG}: {msg}", file=sys.stderr)
    return code


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads, so that a bad host or a port in use fails at
    once. Not listening yet: until the server starts, connections are refused rather than left hanging."""
    # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without
    # it a keep-alive response written in two parts waited 40 ms for the client's delayed ACK
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: no wait on TIME_WAIT
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None) -> int:
    try:
        return _serve(argv)
    except KeyboardInterrupt:  # Ctrl-C while loading, or uvicorn's re-raise after its own clean shutdown
        return 130


def _serve(argv: list[str] | None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    try:  # every check that needs no weights, before any load
        srv = server_config(args)
        cfg = engine_config(args)
    except ConfigError as e:
        return _fail(cli_text(e))
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))
    try:
        sock = listen_socket(srv.host, srv.port)
    except OSError as e:
        return _fail(f"cannot listen on {_address(srv.host, srv.port)}: {e.strerror or e}")
    port = sock.getsockname()[1]  # --port 0: the one the system chose
    logging.basicConfig(level=srv.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .engine import LLMEngine
    from .version import version_line

    try:
        if cfg.device == "cuda":
            from .cuda_backend import cuda_engine
            cuda_engine()  # not built, or no GPU: refused before anything loads, in one line as above
        log.info("%s", version_line())
        engine = LLMEngine(cfg)
    except OptionMessage as e:
        sock.close()
        return _fail(f"cannot start the engine: {cli_text(e)}", 1)
    except (RuntimeError, ValueError, FileNotFoundError, MemoryError) as e:  # out of memory, bad weights
        sock.close()
        return _fail(f"cannot start the engine: {e}", 1)
    import uvicorn

    from .server import build_app

    name = srv.served_model_name or os.path.basename(os.path.normpath(cfg.model_path))
    log.info("engine ready in %.1f s (device=%s, max_model_len=%s)", time.perf_counter() - t0, cfg.device,
             cfg.max_model_len)
    app = build_app(engine, served_model_name=name, api_key=srv.api_key,
                    max_body_bytes=int(srv.max_body_mib * (1 << 20)), body_read_timeout=srv.body_read_timeout,
                    max_queue_wait=srv.max_queue_wait)
    ae = app.state.openinfer.engine

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                log.info("serving '%s' on http://%s: ready %.1f s after start", name, _address(srv.host, port),
                         time.perf_counter() - t0)

        async def shutdown(self, sockets=None):
            # uvicorn stops accepting and waits for the open requests; what is still running after
            # --shutdown-timeout is ended with an error (a last SSE error event and [DONE]), so that it
            # finishes well inside uvicorn's own limit instead of being cut mid-chunk
            log.info("stopping: in-flight requests have %g s to finish", srv.shutdown_timeout)
            asyncio.get_running_loop().call_later(
                srv.shutdown_timeout, ae.end_all,
                f"the server is shutting down (--shutdown-timeout {srv.shutdown_timeout:g} s passed)")
            await super().shutdown(sockets)

    # access lines are INFO: below that level uvicorn would still format each one's fields, then drop it
    server = _Server(uvicorn.Config(app, log_level=srv.log_level, access_log=srv.log_level in ("debug", "info"),
                                    timeout_graceful_shutdown=srv.shutdown_timeout + SHUTDOWN_GRACE_S))
    ae.on_fatal = lambda: setattr(server, "should_exit", True)  # the engine cannot recover: stop, exit 1
    # uvicorn re-raises the signal it stopped on to the handler found before it; for SIGTERM (a supervisor's
    # stop) that handler does nothing, so a clean stop exits 0 instead of dying by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    # What is loaded by now (the tokenizer's tables, the engine's objects) lives as long as the process:
    # out of every later collection, a full one need not walk it while the server is under load.
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])
    if ae.fatal is not None:
        log.error("the engine failed and did not recover (%s); exiting with status 1", ae.fatal)
        return 1
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
