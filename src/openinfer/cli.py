"""`openinfer-serve`: the OpenAI-compatible server on one model directory. Its flags are generated from
the fields of EngineConfig and ServerConfig (openinfer.config), help text and defaults included."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
import types
import typing

from .config import ConfigError, EngineConfig, ServerConfig

log = logging.getLogger("openinfer")
PROG = "openinfer-serve"


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


def _add_options(p: argparse.ArgumentParser, cls) -> None:
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not f.init or meta.get("hidden") or "help" not in meta:
            continue
        t = _base_type(f.type)
        default = f.default
        shown = meta["help"] + ("" if default is None else f" (default: {str(default).lower() if t is bool else default})")
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=shown)
        if t is bool:
            kw.update(type=_bool, nargs="?", const=True, metavar="{true,false}")
        else:
            kw.update(type=t, choices=meta.get("choices"))
            if meta.get("choices"):
                kw["metavar"] = "{" + ",".join(meta["choices"]) + "}"
        if f.name == "model_path":
            kw["required"] = True
        p.add_argument(flag_of(f.name), **kw)
        for alias in meta.get("aliases", ()):  # --no-prefix-cache: the one negative spelling kept
            p.add_argument(alias, dest=f.name, action="store_const", const=not default, default=argparse.SUPPRESS,
                           help=f"the same as {flag_of(f.name)} {str(not default).lower()}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Serve a Qwen3 model directory over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, "
                    "/tokenize, /detokenize).")
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


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    args = build_parser().parse_args(argv)
    srv = server_config(args)
    logging.basicConfig(level=srv.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = engine_config(args)
    except ConfigError as e:
        return _fail(e.render(flag_of))
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))

    import uvicorn

    from .engine import LLMEngine
    from .server import build_app

    try:
        engine = LLMEngine(cfg)
    except (RuntimeError, ValueError, FileNotFoundError, MemoryError) as e:  # no GPU, no CUDA engine, bad weights
        return _fail(f"cannot start the engine: {e}", 1)
    name = srv.served_model_name or os.path.basename(os.path.normpath(cfg.model_path))
    log.info("engine ready in %.1f s (device=%s, max_model_len=%s)", time.perf_counter() - t0, cfg.device,
             cfg.max_model_len)
    app = build_app(engine, served_model_name=name, api_key=srv.api_key,
                    max_body_bytes=int(srv.max_body_mib * (1 << 20)))

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                log.info("serving '%s' on http://%s:%d: ready %.1f s after start", name, srv.host, srv.port,
                         time.perf_counter() - t0)

    server = _Server(uvicorn.Config(app, host=srv.host, port=srv.port, log_level=srv.log_level,
                                    timeout_graceful_shutdown=5))
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
