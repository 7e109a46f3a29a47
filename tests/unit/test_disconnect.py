"""router/disconnect.py: an HTTP answer's stream stops when its client leaves, and the request
path's cleanup runs to the end even where the handler itself is cancelled (no Ray here; the
cluster case is in test_e2e.py)."""

import asyncio

import anyio
import pytest

from router.disconnect import follow


class Path:
    """A stand-in for the request path's stream: tokens every 10 ms, and a cleanup that
    awaits (as closing the decode stream and releasing the KV lease do)."""

    def __init__(self, num_items: int = 1000, fail_at: int | None = None):
        self.num_items, self.fail_at = num_items, fail_at
        self.sent, self.cleaned_up = 0, False

    async def stream(self):
        try:
            for i in range(self.num_items):
                if i == self.fail_at:
                    raise ValueError("decode pool failed")
                await asyncio.sleep(0.01)
                self.sent += 1
                yield i
        finally:
            await asyncio.sleep(0.05)  # an awaited cleanup: must not be cut short
            self.cleaned_up = True


def client(disconnect_after_s: float | None):
    """An ASGI receive: the request body, then http.disconnect after the delay (never if None)."""
    messages = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if messages:
            return messages.pop()
        if disconnect_after_s is None:
            await asyncio.Event().wait()
        await asyncio.sleep(disconnect_after_s)
        return {"type": "http.disconnect"}

    return receive


async def settle(path: Path, deadline_s: float = 5.0) -> None:
    async def done():
        while not path.cleaned_up:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(done(), deadline_s)


def test_items_pass_through_and_the_end_is_the_streams():
    async def run():
        path = Path(num_items=5)
        got = [item async for item in follow(path.stream(), client(None))]
        await settle(path)
        return got, path

    got, path = asyncio.run(run())
    assert got == [0, 1, 2, 3, 4] and path.cleaned_up


def test_the_streams_error_is_raised_to_the_consumer():
    async def run():
        path = Path(fail_at=3)
        got = []
        with pytest.raises(ValueError, match="decode pool failed"):
            async for item in follow(path.stream(), client(None)):
                got.append(item)
        await settle(path)
        return got, path

    got, path = asyncio.run(run())
    assert got == [0, 1, 2] and path.cleaned_up


def test_a_disconnect_ends_the_answer_and_stops_the_stream():
    async def run():
        path = Path()
        got = [item async for item in follow(path.stream(), client(disconnect_after_s=0.1))]
        await settle(path)
        sent = path.sent
        await asyncio.sleep(0.1)
        return got, path, sent

    got, path, sent = asyncio.run(run())
    assert 3 <= len(got) < 100 and path.cleaned_up
    assert path.sent == sent  # nothing more was generated once it was stopped


def test_cleanup_survives_a_handler_cancelled_level_triggered():
    """Starlette's StreamingResponse cancels its task group's scope when the client leaves:
    anyio then cancels every later await of the handler, its finally blocks included. The
    stream's cleanup runs in its own task, so it still ends."""

    async def run():
        path = Path()
        events = []

        async def handler():
            items = follow(path.stream(), client(None))
            try:
                async for item in items:
                    events.append(item)
            finally:
                await items.aclose()  # would be interrupted at its first await
                await asyncio.sleep(0)  # cancelled here, level-triggered

        with anyio.move_on_after(0.1):
            await handler()
        await settle(path)
        return events, path

    events, path = asyncio.run(run())
    assert 3 <= len(events) < 100 and path.cleaned_up


def test_closing_the_consumer_early_stops_the_stream():
    async def run():
        path = Path()
        items = follow(path.stream(), client(None))
        got = [await items.__anext__() for _ in range(3)]
        await items.aclose()
        await settle(path)
        return got, path

    got, path = asyncio.run(run())
    assert got == [0, 1, 2] and path.cleaned_up
