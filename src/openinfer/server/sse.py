"""Server-sent events: the streaming response and its event lines."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from starlette.responses import StreamingResponse

from .async_engine import EngineStepError
from .protocol import engine_error, internal

log = logging.getLogger("openinfer.server")

DONE = "data: [DONE]\n\n"


# json.dumps(obj, ensure_ascii=False) builds an encoder per call; this one is built once (it keeps no
# state between calls): ~17 us less per event on the 2-vCPU VM right after a step.
_ENCODE = json.JSONEncoder(ensure_ascii=False).encode


def event(obj: Any) -> str:
    return f"data: {_ENCODE(obj)}\n\n"


def error_event(e: Exception) -> str:
    """An error after the SSE headers went out is reported in-band rather than cutting the stream."""
    if isinstance(e, EngineStepError):
        return event(engine_error(e).body())
    log.exception("stream failed")
    return event(internal(f"internal error: {type(e).__name__}").body())


class CancelOnDisconnect:
    """`async with CancelOnDisconnect(receive) as w:` runs its body in the current task while a watcher
    task reads `receive`; when the client disconnects, the body is cancelled and the block ends there
    (`w.gone`), the cancellation not propagated. The watcher is cancelled when the block ends.

    What anyio's task group did for SSEResponse, one task cheaper and without cancel scopes: a streamed
    response's start and end cost ~11 us in a warm loop against ~85, and ~120 against ~370 right after a
    step (2-vCPU VM), most of it after the last token, where the next request of a client waits on it."""

    def __init__(self, receive):
        self._receive = receive
        self.gone = False

    async def __aenter__(self) -> "CancelOnDisconnect":
        self._task = asyncio.current_task()
        self._watch = asyncio.ensure_future(self._wait())
        return self

    async def _wait(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self._task.cancel()

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        # the body ended first: the watcher has not run since (a disconnect it reads now cancels nothing)
        self._watch.cancel()
        if self.gone and exc_type is not None and issubclass(exc_type, asyncio.CancelledError):
            uncancel = getattr(self._task, "uncancel", None)  # Python 3.11+: the task's count of requests
            if uncancel is not None:
                uncancel()
            return True
        return False


class SSEResponse(StreamingResponse):
    """Server-sent events that always watch for a disconnect (whatever the ASGI spec version) and
    always run `on_close`, so an abandoned stream frees its engine requests at once."""

    def __init__(self, content: AsyncIterator[str], on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with CancelOnDisconnect(receive):
                await self.stream_response(send)
        except OSError:
            pass
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
