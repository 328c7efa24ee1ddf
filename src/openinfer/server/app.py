"""The starlette app over an AsyncEngine: state, lifespan and middleware around the routes
(`routes.py`; SSE in `sse.py`, logprobs in `logprobs.py`, validation in `protocol.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware

from ..chat import ChatTemplate
from ..sampling_params import sampling_defaults
from .async_engine import AsyncEngine
from .metrics import ARRIVAL, Metrics
from .routes import ServerState, http_error, routes

log = logging.getLogger("openinfer.server")

DEFAULT_MAX_BODY_BYTES = 8 << 20


class _Entry:
    """What every request passes first. Its arrival stamp (the path trace's first boundary: the first of
    our code it runs; uvicorn has parsed its headers, not read its body). And '/v1/completions/' served
    as '/v1/completions': Starlette would answer 307 to the path without the slash, and HTTP clients do
    not repeat a POST after a redirect by default."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        scope[ARRIVAL] = time.perf_counter_ns()
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            scope = dict(scope, path=path.rstrip("/") or "/")
        await self.app(scope, receive, send)


def build_app(engine: Any, *, served_model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              chat_template: ChatTemplate | None = None, body_read_timeout: float = 30.0,
              max_queue_wait: float = 5.0) -> Starlette:
    """The ASGI app over a constructed LLMEngine; the engine loop starts with the app's lifespan."""
    ae = AsyncEngine(engine, max_queue_wait=max_queue_wait)
    tok = engine.tokenizer
    tok.max_token_bytes  # worked out now (152k tokens), not under the first long prompt
    files = tok.files  # the model directory's files, as the engine's tokenizer read them
    if chat_template is None and files.chat_template:
        chat_template = ChatTemplate(files.chat_template)
    defaults = sampling_defaults(files.generation_config)
    if defaults:
        log.info("sampling defaults from %s: %s", files.path / "generation_config.json", defaults)
    st = ServerState(engine=ae, tokenizer=tok, template=chat_template, model_name=served_model_name,
                     max_model_len=engine.config.max_model_len,
                     vocab_size=engine.model_config.vocab_size, api_key=api_key,
                     max_body_bytes=max_body_bytes, metrics=Metrics(ae, served_model_name),
                     defaults=defaults, body_read_timeout=body_read_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        ae.start()
        st.metrics.start()
        watch = asyncio.create_task(st.metrics.watch_loop())
        try:
            yield
        finally:
            watch.cancel()
            st.metrics.close()
            ae.shutdown()

    app = Starlette(routes=routes(), lifespan=lifespan, middleware=[Middleware(_Entry)],
                    exception_handlers={HTTPException: http_error})
    app.state.openinfer = st
    return app
