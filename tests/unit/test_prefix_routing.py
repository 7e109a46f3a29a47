"""Prefix-aware routing's policy (router/prefix_routing.py) on plain replica records, no Ray cluster."""

from types import SimpleNamespace

from pdserve.engine.block_manager import chain_hash
from pdserve.messages import PrefillRequest
from pdserve.sampling import SamplingParams
from router.prefix_routing import PrefixAwareRouter, PrefixIndex, block_hashes


def replicas(n: int):
    return [SimpleNamespace(replica_id=f"r{i}") for i in range(n)]


def pending(prompt: list[int], rid: str):
    return SimpleNamespace(args=(PrefillRequest(rid, prompt, SamplingParams()),), metadata=SimpleNamespace(internal_request_id=rid))


def router(capacity_blocks: int = 1024) -> PrefixAwareRouter:
    r = PrefixAwareRouter.__new__(PrefixAwareRouter)  # the policy alone; Ray Serve's base class state is not used by it
    r.initialize_state(block_size=4, capacity_blocks=capacity_blocks)
    return r


def route(r: PrefixAwareRouter, candidates, prompt: list[int], rid: str) -> str:
    import asyncio

    ranks = asyncio.run(r.choose_replicas(candidates, pending(prompt, rid)))
    chosen = sorted(ranks[0], key=lambda x: x.replica_id)[0]  # (Ray Serve takes the shorter queue within a rank)
    r.on_request_routed(pending(prompt, rid), chosen.replica_id, None)
    return chosen.replica_id


def test_block_hashes_are_the_prefix_caches_keys():
    prompt = list(range(10, 21))  # 11 tokens: 2 full blocks of 4, the rest never cached
    assert block_hashes(prompt, 4) == [chain_hash(None, (10, 11, 12, 13)), chain_hash(chain_hash(None, (10, 11, 12, 13)), (14, 15, 16, 17))]


def test_a_shared_prefix_returns_to_its_replica_and_spills_over_when_queued():
    r, candidates = router(), replicas(2)
    system = list(range(100, 132))  # 32 tokens = 8 blocks
    first = route(r, candidates, system + [1, 2, 3], "a")
    r.on_request_completed(first, "a")
    for i in range(4):  # one at a time: each finds the prefix where the first went
        assert route(r, candidates, system + [5 + i] * 3, f"b{i}") == first
        r.on_request_completed(first, f"b{i}")
    assert r.num_routed_by_prefix == 4
    # queued: 35 tokens wait at `first`; a new prompt there costs 3 + 35, elsewhere 35 + 0
    route(r, candidates, system + [9, 9, 9], "q1")
    other = route(r, candidates, system + [8, 8, 8], "q2")
    assert other != first  # the queue outweighs the 32 cached tokens
    assert r.queued == {first: 35, other: 35}


def test_distinct_prompts_balance_by_queued_tokens():
    r, candidates = router(), replicas(2)
    chosen = [route(r, candidates, [7 * i + j for j in range(40)], f"p{i}") for i in range(6)]
    assert chosen.count("r0") == chosen.count("r1") == 3
    for i, replica in enumerate(chosen):
        r.on_request_completed(replica, f"p{i}")
    assert r.queued == {"r0": 0, "r1": 0} and r.in_flight == {}


def test_calls_without_a_prompt_may_go_to_any_replica():
    import asyncio

    r, candidates = router(), replicas(3)
    ranks = asyncio.run(r.choose_replicas(candidates, SimpleNamespace(args=("transfer-id",), metadata=None)))
    assert ranks == [candidates]


def test_the_index_keeps_at_most_capacity_blocks_per_replica():
    index = PrefixIndex(capacity_blocks=3)
    old, new = block_hashes(list(range(8)), 4), block_hashes(list(range(100, 112)), 4)
    index.add("r", old)
    index.add("r", new)  # 5 blocks into 3: the two oldest go
    assert index.overlap("r", old) == 0 and index.overlap("r", new) == 3
