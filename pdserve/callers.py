"""No work for callers that died: a pool replica stops the requests of a router replica that is gone.

Ray does not cancel an actor task whose caller died. Without this, when a router replica
dies, decode would run its streams on to ``max_tokens`` for nobody and prefill would hold
their KV leases until they expire, both holding KV blocks.

Each request names its caller, the router replica that sent it (``Caller``: its Ray actor).
A pool replica registers the request under its caller while it runs the request
(``running``), and prefill also while the request's KV lease is held (``hold``). While a
caller has requests here, ``CallerWatch`` pings it every ``interval_s`` (a heartbeat per
caller, not per request); once Ray reports its actor dead, each of its requests is stopped
(``on_gone``: decode ends the stream and frees the blocks; prefill releases the lease) and
the task running it is cancelled (a fetch or a prefill still under way ends as a client
cancel does). A request that arrives from a caller already known dead is stopped at once.
A ping that times out or finds the actor unreachable proves nothing: it is tried again at
the next tick.

With ``interval_s`` = 1 and Ray marking a killed actor dead within a second, a dead
router's requests are stopped within about 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterator

log = logging.getLogger(__name__)

DEAD_REMEMBERED = 1024  # caller ids known dead, kept to stop their late requests at once


@dataclass(frozen=True)
class Caller:
    """The router replica that sent a request: ``actor_id`` (hex) and its Ray ``handle``."""

    actor_id: str
    handle: Any = field(compare=False, repr=False)


def this_actor() -> Caller | None:
    """The calling Ray actor (a router replica) as a Caller; None outside a Ray actor."""
    try:
        import ray

        ctx = ray.get_runtime_context()
        actor_id = ctx.get_actor_id()
        return Caller(actor_id, ctx.current_actor) if actor_id else None
    except Exception:  # noqa: BLE001 - not in a Ray actor (tests, a driver): nothing to watch
        return None


async def ray_probe(caller: Caller, timeout_s: float) -> bool | None:
    """Is ``caller``'s actor alive? True: it answered; False: Ray reports it dead
    (ActorDiedError); None: no answer within ``timeout_s`` or unreachable for now."""
    from ray.exceptions import ActorDiedError, RayActorError

    try:
        await asyncio.wait_for(caller.handle.__ray_ready__.remote(), timeout_s)
        return True
    except ActorDiedError:
        return False
    except (RayActorError, asyncio.TimeoutError):
        return None


@dataclass
class _Entry:
    until: float  # monotonic s after which a hold lapses (inf while running)
    task: asyncio.Task | None  # the task running the request, cancelled if its caller dies


class CallerWatch:
    """Requests by caller; stops those of callers that died (see the module doc).

    ``on_gone(request_id)``: stops one request (called on the event loop). ``probe``: a
    liveness check as ``ray_probe``. Every method runs on the replica's event loop."""

    def __init__(self, on_gone: Callable[[str], None], probe: Callable[[Caller, float], Awaitable[bool | None]] = ray_probe,
                 interval_s: float = 1.0, probe_timeout_s: float = 5.0):
        self.on_gone, self.probe = on_gone, probe
        self.interval_s, self.probe_timeout_s = interval_s, probe_timeout_s
        self._requests: dict[str, dict[str, _Entry]] = {}  # caller id -> request id -> entry
        self._callers: dict[str, Caller] = {}
        self._dead: OrderedDict[str, None] = OrderedDict()
        self._loop_task: asyncio.Task | None = None
        self.num_stopped = 0  # requests stopped because their caller died

    @contextlib.contextmanager
    def running(self, caller: Caller | None, request_id: str) -> Iterator[None]:
        """Registers the request (and the current task) under ``caller`` for the block's
        duration. If ``caller`` is already known dead, the request is stopped at once."""
        if caller is None:
            yield
            return
        entry = _Entry(float("inf"), asyncio.current_task())
        if not self._add(caller, request_id, entry):
            self.num_stopped += 1
            raise asyncio.CancelledError(f"the caller of {request_id} is gone")
        try:
            yield
        finally:
            self._discard(caller.actor_id, request_id, entry)

    def hold(self, caller: Caller | None, request_id: str, hold_s: float) -> None:
        """Registers a request whose KV stays leased here for up to ``hold_s`` seconds
        (prefill, after its reply): ``on_gone`` frees it if the caller dies meanwhile."""
        entry = _Entry(time.monotonic() + hold_s, None)
        if caller is not None and not self._add(caller, request_id, entry):
            self._stop(request_id, entry)

    def _add(self, caller: Caller, request_id: str, entry: _Entry) -> bool:
        """False (nothing added) if ``caller`` is known dead."""
        if caller.actor_id in self._dead:
            return False
        self._callers[caller.actor_id] = caller
        self._requests.setdefault(caller.actor_id, {})[request_id] = entry
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._watch())
        return True

    def _discard(self, caller_id: str, request_id: str, entry: _Entry) -> None:
        requests = self._requests.get(caller_id)
        if requests is not None and requests.get(request_id) is entry:
            del requests[request_id]

    def _stop(self, request_id: str, entry: _Entry) -> None:
        self.num_stopped += 1
        try:
            self.on_gone(request_id)
        except Exception:  # noqa: BLE001 - one request's clean-up must not keep the others running
            log.exception("stopping %s of a dead caller failed", request_id)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            for caller_id in list(self._requests):
                requests = self._requests[caller_id]
                for rid in [rid for rid, e in requests.items() if e.until < now]:
                    del requests[rid]
                if not requests:
                    del self._requests[caller_id]
                    self._callers.pop(caller_id, None)
            if not self._requests:
                self._loop_task = None
                return
            ids = list(self._requests)
            alive = await asyncio.gather(*(self.probe(self._callers[c], self.probe_timeout_s) for c in ids), return_exceptions=True)
            for caller_id, answer in zip(ids, alive):
                if answer is not False:
                    continue
                self._dead[caller_id] = None
                while len(self._dead) > DEAD_REMEMBERED:
                    self._dead.popitem(last=False)
                self._callers.pop(caller_id, None)
                orphans = self._requests.pop(caller_id, {})
                log.warning("caller %s is gone: stopping its %d requests here", caller_id, len(orphans))
                for rid, entry in orphans.items():
                    self._stop(rid, entry)

    def stats(self) -> dict[str, int]:
        return {"num_callers_watched": len(self._requests), "num_stopped_for_dead_caller": self.num_stopped}

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
