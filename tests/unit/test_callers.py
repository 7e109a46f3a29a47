"""pdserve/callers.py on a scripted liveness probe (the Ray one is exercised by
tests/cluster/test_orphans.py, which kills a real router replica): a dead caller's
requests are stopped and their tasks cancelled, a live or unreachable one's are not, a
late request from a dead caller is refused, and holds lapse."""

import asyncio

import pytest

from pdserve.callers import Caller, CallerWatch


class Probe:
    """Liveness by caller id: True alive, False dead, None no answer."""

    def __init__(self):
        self.alive: dict[str, bool | None] = {}
        self.calls = 0

    async def __call__(self, caller: Caller, timeout_s: float) -> bool | None:
        self.calls += 1
        return self.alive.get(caller.actor_id, True)


A, B, C = Caller("a", None), Caller("b", None), Caller("c", None)


async def until(predicate, polls: int = 500) -> None:
    for _ in range(polls):  # a deadline that only catches a hang
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_a_dead_callers_requests_are_stopped_and_only_theirs():
    async def main():
        stopped, probe = [], Probe()
        watch = CallerWatch(stopped.append, probe, interval_s=0.01)

        async def request(caller: Caller, rid: str) -> str:
            with watch.running(caller, rid):
                await asyncio.sleep(60)
            return "done"

        tasks = {rid: asyncio.ensure_future(request(caller, rid)) for caller, rid in ((A, "a1"), (B, "b1"), (B, "b2"), (C, "c1"))}
        watch.hold(B, "b-lease", 60.0)
        await until(lambda: probe.calls >= 6)  # a few ticks with everyone alive: nothing stopped
        assert stopped == [] and watch.stats()["num_callers_watched"] == 3
        probe.alive["c"] = None  # no answer proves nothing
        probe.alive["b"] = False
        await until(lambda: len(stopped) == 3)
        assert sorted(stopped) == ["b-lease", "b1", "b2"]
        await asyncio.gather(tasks["b1"], tasks["b2"], return_exceptions=True)
        assert tasks["b1"].cancelled() and tasks["b2"].cancelled()
        assert not tasks["a1"].done() and not tasks["c1"].done()
        with pytest.raises(asyncio.CancelledError):  # a late request from the dead caller: refused at once
            with watch.running(B, "b3"):
                pass
        watch.hold(B, "b-late-lease", 60.0)  # ... and a late lease released at once
        assert stopped[-1] == "b-late-lease" and watch.stats() == {"num_callers_watched": 2, "num_stopped_for_dead_caller": 5}
        for rid in ("a1", "c1"):
            tasks[rid].cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await until(lambda: watch.stats()["num_callers_watched"] == 0)  # finished requests leave the table
        watch.close()

    asyncio.run(main())


def test_holds_lapse_and_the_watch_stops_pinging():
    async def main():
        stopped, probe = [], Probe()
        watch = CallerWatch(stopped.append, probe, interval_s=0.01)
        watch.hold(A, "lease", 0.05)
        await until(lambda: watch.stats()["num_callers_watched"] == 0)
        calls = probe.calls
        await asyncio.sleep(0.1)
        assert probe.calls == calls and stopped == []  # nothing held: no pings
        probe.alive["a"] = False
        watch.hold(A, "lease2", 60.0)  # the loop starts again with the next request
        await until(lambda: stopped == ["lease2"])
        watch.close()

    asyncio.run(main())


def test_a_request_without_a_caller_is_not_watched():
    async def main():
        watch = CallerWatch(lambda rid: None, Probe(), interval_s=0.01)
        with watch.running(None, "r"):
            assert watch.stats()["num_callers_watched"] == 0
        watch.hold(None, "r", 1.0)
        assert watch.stats()["num_callers_watched"] == 0

    asyncio.run(main())
