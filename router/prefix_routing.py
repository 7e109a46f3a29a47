"""Prefix-aware routing across prefill replicas: a Ray Serve request router.

Each prompt goes to the prefill replica where it is expected to finish first, with
Dynamo's KV-aware router's cost (NVIDIA Dynamo, ``kv_router``: overlap blocks against
load), in prompt tokens:

    cost(replica) = (prompt tokens - tokens of its longest prefix cached there)
                    + prompt tokens already routed there and not yet done

The first term is the prefill the replica must compute, the second the queue ahead of
it; both cost prefill time at one rate, so the sum estimates when the prompt's prefill
ends. A shared system prompt therefore goes back to the replica that holds it until that
replica's queue outweighs the saving, and then spills over.

What a replica caches is tracked here, by the engine's own block hashes
(``pdserve.engine.block_manager.chain_hash`` over ``block_size``-token blocks): the blocks
of every prompt routed to it, least recently used evicted past ``capacity_blocks`` (its
KV pool). It is an estimate (a replica may have evicted more), as Dynamo's and SGLang's
approximate routers are. Replicas rank by cost; Ray Serve takes the first rank that
has room (``max_ongoing_requests``), the shorter queue among equal costs. A lease release
by request id goes to the replica the request was routed to (router/holder_routing.py);
other calls without a prompt (stats) may go to any replica.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RunningReplica

from pdserve.engine.block_manager import chain_hash
from router.holder_routing import HolderAwareRouter


def block_hashes(prompt_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hash of each full ``block_size``-token block of the prompt, as the prefix
    cache keys them."""
    hashes, prev = [], None
    for start in range(0, len(prompt_ids) - block_size + 1, block_size):
        prev = chain_hash(prev, tuple(prompt_ids[start:start + block_size]))
        hashes.append(prev)
    return hashes


class PrefixIndex:
    """Which block hashes each replica is expected to hold, LRU-bounded per replica."""

    def __init__(self, capacity_blocks: int):
        self.capacity = capacity_blocks
        self.blocks: dict[Any, OrderedDict[bytes, None]] = {}

    def overlap(self, replica: Any, hashes: list[bytes]) -> int:
        """Leading blocks of ``hashes`` held by ``replica``."""
        held, n = self.blocks.get(replica), 0
        if held:
            for h in hashes:
                if h not in held:
                    break
                n += 1
        return n

    def add(self, replica: Any, hashes: list[bytes]) -> None:
        held = self.blocks.setdefault(replica, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def remove(self, replica: Any) -> None:
        self.blocks.pop(replica, None)


def prompt_of(request: PendingRequest | None) -> list[int] | None:
    """The prompt ids of a prefill call (a PrefillRequest argument), else None."""
    for arg in (request.args if request is not None else ()) or ():
        ids = getattr(arg, "prompt_ids", None)
        if isinstance(ids, list):
            return ids
    return None


class PrefixAwareRouter(HolderAwareRouter):
    """Ray Serve request router for the prefill pool (``router.prefix_routing``); see the module doc.

    ``initialize_state`` kwargs (``request_router_kwargs``): block_size (tokens per KV block,
    the pool's) and capacity_blocks (a replica's KV pool, in blocks)."""

    def initialize_state(self, block_size: int = 16, capacity_blocks: int = 2048, **kwargs) -> None:
        super().initialize_state()
        self.block_size = block_size
        self.index = PrefixIndex(capacity_blocks)
        self.queued: dict[ReplicaID, int] = {}  # prompt tokens routed to each replica and not done
        self.in_flight: dict[str, tuple[ReplicaID, int]] = {}  # internal request id -> (replica, tokens)
        self.num_routed_by_prefix = 0  # requests sent where part of their prompt was cached

    def costs(self, replicas: list[RunningReplica], prompt_ids: list[int]) -> list[tuple[int, int, RunningReplica]]:
        """(cost in tokens, cached tokens, replica) per replica, cheapest first."""
        hashes = block_hashes(prompt_ids, self.block_size)
        rows = []
        for r in replicas:
            cached = self.index.overlap(r.replica_id, hashes) * self.block_size
            rows.append((len(prompt_ids) - cached + self.queued.get(r.replica_id, 0), cached, r))
        return sorted(rows, key=lambda row: (row[0], -row[1], str(row[2].replica_id)))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        held = self.to_holder(candidate_replicas, pending_request)
        if held is not None:  # a release by id: where the lease is
            return held
        prompt = prompt_of(pending_request)
        if prompt is None:  # not a prefill (stats, an id routed elsewhere): any, Ray Serve takes the shorter queue
            return [list(candidate_replicas)]
        ranks: list[list[RunningReplica]] = []
        last = None
        for cost, _, replica in self.costs(candidate_replicas, prompt):
            if cost == last:
                ranks[-1].append(replica)  # equal cost: Ray Serve picks the shorter queue of these
            else:
                ranks.append([replica])
                last = cost
        return ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        prompt = prompt_of(pending_request)
        if prompt is None:
            return
        hashes = block_hashes(prompt, self.block_size)
        if self.index.overlap(replica_id, hashes):
            self.num_routed_by_prefix += 1
        self.index.add(replica_id, hashes)
        self.queued[replica_id] = self.queued.get(replica_id, 0) + len(prompt)
        self.in_flight[pending_request.metadata.internal_request_id] = (replica_id, len(prompt))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        routed = self.in_flight.pop(internal_request_id, None)
        if routed is not None:
            self.queued[routed[0]] = max(0, self.queued.get(routed[0], 0) - routed[1])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove(replica_id)
        self.queued.pop(replica_id, None)
