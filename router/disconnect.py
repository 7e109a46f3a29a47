"""A request's token stream that stops when its HTTP client leaves or its router drains,
and frees both pools.

Behind Ray Serve's HTTP proxy a client's disconnect does not reliably stop the router's
handler: Starlette's ``StreamingResponse`` only watches for ``http.disconnect`` when the
scope's ASGI spec version is below 2.4, and otherwise waits for ``send`` to fail, which a
Serve replica's ``send`` never does; and where Starlette does watch, it cancels its task
group's scope, which cancels every later ``await`` of the handler too, so the request
path's own cleanup (closing the decode stream, releasing the KV lease) can be cut short.
A fresh-clone trial on 2026-12-01 saw 3 of 3 streamed requests decode to ``max_tokens``
after their clients had gone.

``follow`` fixes both: it watches ``receive`` for ``http.disconnect`` itself, and it
advances the request path's stream in a task of its own, so that stopping it is one
``Task.cancel()``, whose ``finally`` blocks (router/request_path.py) then run to the end.
The same stop serves a router that drains before a shutdown (``stop``, router/draining.py):
a stream still running at the drain's deadline ends with its error.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict[str, Any]]]

_stopping: set[asyncio.Task] = set()  # pumps cancelled by a consumer that left: held until their cleanup ends


class _End:
    def __init__(self, error: Exception | None = None):
        self.error = error


async def until_disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected (ASGI ``http.disconnect``); never, if
    ``receive`` fails (the request then runs on, as it would without this watch)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a receive we cannot read is no sign that the client left
        log.debug("cannot watch this HTTP request for a disconnect", exc_info=True)
        await asyncio.Event().wait()


async def follow(stream: AsyncIterator, receive: Receive | None = None,
                 stop: Callable[[], Awaitable[BaseException]] | None = None) -> AsyncIterator:
    """``stream``'s items, until it ends (its error re-raised here), the client behind
    ``receive`` disconnects (then this ends early), or what ``stop()`` returns completes
    (then the exception it returns is raised here). In the last two cases ``stream`` is cancelled and closed.

    However this generator is left (exhausted, closed, cancelled), the stream's task is
    cancelled without waiting on it, so a cancelled caller cannot interrupt its cleanup."""
    queue: asyncio.Queue = asyncio.Queue()  # items, then one _End; unbounded, as max_tokens bounds it

    async def pump() -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
            queue.put_nowait(_End())
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(_End(e))

    task = asyncio.create_task(pump())
    gone = asyncio.create_task(until_disconnect(receive)) if receive is not None else None
    stopped = asyncio.ensure_future(stop()) if stop is not None else None
    watches = {w for w in (gone, stopped) if w is not None}
    try:
        while True:
            get = asyncio.ensure_future(queue.get())
            try:
                await asyncio.wait({get, *watches}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not get.done():
                    get.cancel()
            if not get.done() or get.cancelled():
                if stopped is not None and stopped.done():
                    raise stopped.result()
                log.info("HTTP client disconnected; stopping its request")
                return
            item = get.result()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
            yield item
    finally:
        for watch in watches:
            watch.cancel()
        if not task.done():
            task.cancel()  # the stream's finally blocks run in that task, uninterrupted
            _stopping.add(task)
            task.add_done_callback(_stopping.discard)
