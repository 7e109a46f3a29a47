"""A router replica's drain (router/draining.py) over streams that end when told to, with the
stream wrapper the router uses (router/disconnect.py ``follow``); and the routing of a call
to one named router replica (router/replica_calls.py). The real drain, through ``pdserve
down`` on a running cluster: tests/cluster/test_default_cluster.py."""

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.errors import ShuttingDownError
from router.disconnect import follow
from router.draining import Drain
from router.errors import grpc_status_for, retry_after_s
from router.openai_api import error_status
from router.replica_calls import ReplicaTargetRouter, ToReplica, replica_ids


def test_a_drain_lets_streams_finish_then_ends_the_rest_with_an_error():
    async def main():
        in_flight = {"n": 0}
        drain = Drain(lambda: in_flight["n"], retry_after_s=2.0)
        release_short = asyncio.Event()
        cleaned = []

        async def tokens(rid: str, ends: asyncio.Event | None):
            try:
                for i in range(3):
                    yield f"{rid}{i}"
                if ends is not None:
                    await ends.wait()
                    yield f"{rid}-last"
                    return
                await asyncio.Event().wait()  # never ends by itself
            finally:
                cleaned.append(rid)  # the request path's clean-up (frees both pools)

        async def request(rid: str, ends: asyncio.Event | None):
            drain.check()
            in_flight["n"] += 1
            got = []
            try:
                async for item in follow(tokens(rid, ends), None, drain.expired):
                    got.append(item)
                return got, None
            except ShuttingDownError as e:
                return got, e
            finally:
                in_flight["n"] -= 1

        short = asyncio.ensure_future(request("s", release_short))
        long = asyncio.ensure_future(request("l", None))
        while in_flight["n"] < 2:
            await asyncio.sleep(0.01)
        draining = asyncio.ensure_future(drain.run(drain_s=0.5))
        await asyncio.sleep(0)
        with pytest.raises(ShuttingDownError, match="shutting down") as refused:  # no new requests
            await request("new", None)
        release_short.set()  # this one finishes within the drain
        counts = await draining
        (short_items, short_error), (long_items, long_error) = await short, await long
        assert short_items == ["s0", "s1", "s2", "s-last"] and short_error is None
        assert long_items == ["l0", "l1", "l2"] and isinstance(long_error, ShuttingDownError)
        assert counts == {"in_flight": 2, "finished": 1, "cut": 1, "left": 0}
        assert sorted(cleaned) == ["l", "s"] and in_flight["n"] == 0
        return refused.value, long_error

    refused, cut = asyncio.run(main())
    for error in (refused, cut):  # UNAVAILABLE / 503, with the retry hint
        assert grpc_status_for(error)[0].name == "UNAVAILABLE" and error_status(error) == (503, "service_unavailable")
        assert retry_after_s(error, 1.0) == 2.0


def test_an_idle_router_drains_at_once():
    async def main():
        return await Drain(lambda: 0, 1.0).run(drain_s=3600)

    assert asyncio.run(main()) == {"in_flight": 0, "finished": 0, "cut": 0, "left": 0}


def test_a_call_to_a_named_replica_goes_there_or_waits():
    names = ["SERVE_REPLICA::pdserve#router#b2", "SERVE_REPLICA::pdserve#decode#x", "SERVE_REPLICA::pdserve#router#a1", "other"]
    assert replica_ids(names, "pdserve", "router") == ["a1", "b2"]
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("a1", "b2")]
    router = ReplicaTargetRouter.__new__(ReplicaTargetRouter)  # choose_replicas' by-name branch reads no router state

    def choose(target):
        return asyncio.run(router.choose_replicas(replicas, SimpleNamespace(args=(ToReplica(target), 5.0))))

    assert choose("b2") == [[replicas[1]]] and choose("a1") == [[replicas[0]]]
    assert choose("gone") == []  # not running (yet): Ray Serve asks again
