"""Holder-aware routing's policy (router/holder_routing.py) on plain replica records, no Ray
cluster: a call by request id goes to the replica the request was routed to. The same on
real replicas: tests/cluster/test_reliability.py."""

import asyncio
from types import SimpleNamespace

from pdserve.messages import FreshRequest, Migrated, PrefillRequest
from pdserve.sampling import SamplingParams
from router.holder_routing import HolderAwareRouter, HolderIndex
from router.prefix_routing import PrefixAwareRouter


def replicas(n: int):
    return [SimpleNamespace(replica_id=f"r{i}") for i in range(n)]


def call(*args):
    return SimpleNamespace(args=args, metadata=SimpleNamespace(internal_request_id=str(id(args))))


def router(cls=HolderAwareRouter):
    r = cls.__new__(cls)  # the policy alone; Ray Serve's base class state is not used by it
    r.initialize_state()
    return r


def choose(r, candidates, pending) -> list[str]:
    return [x.replica_id for x in asyncio.run(r.choose_replicas(candidates, pending))[0]]


def test_abort_by_id_goes_to_the_replica_running_the_request():
    r, candidates = router(), replicas(4)
    for i in range(32):
        r.on_request_routed(call(FreshRequest(f"req{i}", [1, 2], SamplingParams())), f"r{i % 4}", None)
    for i in range(32):
        assert choose(r, candidates, call(f"req{i}")) == [f"r{i % 4}"]
    assert r.num_routed_to_holder == 32


def test_a_migrated_request_is_aborted_at_its_new_replica():
    r, candidates = router(), replicas(2)
    r.on_request_routed(call(FreshRequest("m", [1], SamplingParams())), "r0", None)
    r.on_request_routed(call(Migrated("m", [1], SamplingParams(), (5, 6, 7))), "r1", None)
    assert choose(r, candidates, call("m")) == ["r1"]


def test_unknown_ids_and_gone_holders_fall_back_to_two_random_replicas():
    r, candidates = router(), replicas(3)
    assert len(set(choose(r, candidates, call("never-routed")))) == 2
    r.on_request_routed(call(FreshRequest("x", [1], SamplingParams())), "r9", None)  # r9 has since died
    picked = choose(r, candidates, call("x"))
    assert len(set(picked)) == 2 and "r9" not in picked and r.num_routed_to_holder == 0
    assert choose(r, replicas(1), call(FreshRequest("y", [1], SamplingParams()))) == ["r0"]


def test_prefill_releases_by_id_go_to_the_lease_holder_under_prefix_routing():
    r = PrefixAwareRouter.__new__(PrefixAwareRouter)
    r.initialize_state(block_size=4, capacity_blocks=64)
    candidates = replicas(2)
    for i in range(8):
        r.on_request_routed(call(PrefillRequest(f"p{i}", [i] * 8, SamplingParams())), f"r{i % 2}", None)
    assert all(choose(r, candidates, call(f"p{i}")) == [f"r{i % 2}"] for i in range(8))
    assert choose(r, candidates, call()) == ["r0", "r1"]  # stats: any replica


def test_the_index_remembers_the_last_ids_only():
    index = HolderIndex(capacity=3)
    for i in range(5):
        index.record(f"id{i}", f"r{i}")
    assert len(index) == 3 and index.holder("id1") is None and index.holder("id4") == "r4"
