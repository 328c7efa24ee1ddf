"""sse.CancelOnDisconnect: the block runs in the calling task; a disconnect cancels it and ends the block
quietly; anything else (its own end, its errors, a cancellation from elsewhere) passes as it would."""
import asyncio
import sys

import pytest

from openinfer.server.sse import CancelOnDisconnect, SSEResponse


class Client:
    """An ASGI receive: blocks until the test says the client is gone (or the response is complete)."""

    def __init__(self):
        self.gone = asyncio.Event()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}


def _cancelling(task) -> int:
    return task.cancelling() if sys.version_info >= (3, 11) else 0


def test_the_block_ends_on_its_own():
    async def main():
        c = Client()
        async with CancelOnDisconnect(c.receive) as w:
            await asyncio.sleep(0.01)
        c.gone.set()  # read by nobody now: cancels nothing
        await asyncio.sleep(0.01)
        assert not w.gone and w._watch.cancelled() and _cancelling(asyncio.current_task()) == 0
        return "done"
    assert asyncio.run(main()) == "done"


def test_a_disconnect_cancels_the_block_and_ends_it_quietly():
    async def main():
        c = Client()
        reached = []
        asyncio.get_running_loop().call_later(0.01, c.gone.set)
        async with CancelOnDisconnect(c.receive) as w:
            await asyncio.sleep(10)
            reached.append(1)
        assert w.gone and not reached and _cancelling(asyncio.current_task()) == 0
        await asyncio.sleep(0.001)  # the task goes on, uncancelled
        return "done"
    assert asyncio.run(main()) == "done"


def test_errors_and_outside_cancellations_pass():
    async def fails():
        async with CancelOnDisconnect(Client().receive):
            raise OSError("broken pipe")

    async def waits():
        async with CancelOnDisconnect(Client().receive):
            await asyncio.sleep(10)

    async def main():
        with pytest.raises(OSError):
            await fails()
        t = asyncio.ensure_future(waits())
        await asyncio.sleep(0.01)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
    asyncio.run(main())


def test_sse_response_closes_once_whether_it_ends_or_the_client_goes():
    async def run(disconnect_after: int):
        c, sent, closed = Client(), [], []

        async def events():
            for i in range(5):
                await asyncio.sleep(0.002)
                yield f"data: {i}\n\n"

        async def send(message):
            sent.append(message)
            if len([m for m in sent if m.get("body")]) == disconnect_after:
                c.gone.set()

        await SSEResponse(events(), lambda: closed.append(1))({"type": "http"}, c.receive, send)
        return [m.get("body") for m in sent if m["type"] == "http.response.body"], closed

    bodies, closed = asyncio.run(run(disconnect_after=99))
    assert bodies == [f"data: {i}\n\n".encode() for i in range(5)] + [b""] and closed == [1]
    bodies, closed = asyncio.run(run(disconnect_after=2))
    assert bodies == [b"data: 0\n\n", b"data: 1\n\n"] and closed == [1]
