"""Calls by request id reach the replica that holds the request: a Ray Serve request router.

A pool's replicas each hold their own requests: decode runs a request's sequence and its KV
blocks, prefill holds the KV lease it made for it (leased under the request id). A call that
names a request by id alone (``decode.abort(request_id)``, ``prefill.release(request_id)``)
is only useful at that replica; any other one finds nothing. Ray Serve routes each call on
its own, so with N replicas such a call would reach the holder 1 time in N.

This router remembers, in the router process, which replica each request was sent to (the
``request_id`` of a ``PrefillRequest``/``DecodeRequest`` argument, recorded when Ray Serve
reports the call routed; a migrated request is recorded again at its new replica). A call
whose first argument is a bare id string goes to that replica, and to any replica when the
id is unknown (never routed from this router process) or its replica has gone (then there
is nothing left to stop: its requests died with it). Other calls are routed by the power of
two choices: two random replicas, the shorter queue of the two (Ray Serve's default policy).

Only the last ``capacity`` ids are remembered (least recently routed dropped); an id stays
after its call ends, as the abort or release that follows a cancel may be routed after Ray
Serve has reported the cancelled call completed.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

HOLDERS_REMEMBERED = 65536


def carried_request_id(request: PendingRequest | None) -> str | None:
    """The request id a call carries as a request object's ``request_id`` (prefill, generate), else None."""
    for arg in (request.args if request is not None else ()) or ():
        rid = getattr(arg, "request_id", None)
        if isinstance(rid, str):
            return rid
    return None


def named_request_id(request: PendingRequest | None) -> str | None:
    """The id a call names as its first argument, a bare string (abort, release by id), else None."""
    args = (request.args if request is not None else ()) or ()
    return args[0] if args and isinstance(args[0], str) else None


class HolderIndex:
    """request id -> the replica it was last routed to, the last ``capacity`` ids."""

    def __init__(self, capacity: int = HOLDERS_REMEMBERED):
        self.capacity = capacity
        self._holders: OrderedDict[str, ReplicaID] = OrderedDict()

    def record(self, request_id: str, replica_id: ReplicaID) -> None:
        self._holders[request_id] = replica_id
        self._holders.move_to_end(request_id)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def holder(self, request_id: str) -> ReplicaID | None:
        return self._holders.get(request_id)

    def __len__(self) -> int:
        return len(self._holders)


class HolderAwareRouter(RequestRouter):
    """Ray Serve request router of the decode (and colocated) pool, and the base of the
    prefill pool's (router/prefix_routing.py); see the module doc."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.holders = HolderIndex()
        self.num_routed_to_holder = 0  # by-id calls sent to the replica recorded for their id

    def holder_of(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None) -> RunningReplica | None:
        """The live replica a by-id call must reach, or None (not a by-id call, or no known holder)."""
        request_id = named_request_id(pending_request)
        holder = self.holders.holder(request_id) if request_id is not None else None
        for replica in candidate_replicas if holder is not None else ():
            if replica.replica_id == holder:
                return replica
        return None

    def to_holder(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None) -> list[list[RunningReplica]] | None:
        """The ranks for a by-id call whose holder is live (that replica alone), else None."""
        holder = self.holder_of(candidate_replicas, pending_request)
        if holder is None:
            return None
        self.num_routed_to_holder += 1
        return [[holder]]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return self.to_holder(candidate_replicas, pending_request) or [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        request_id = carried_request_id(pending_request)
        if request_id is not None:
            self.holders.record(request_id, replica_id)
