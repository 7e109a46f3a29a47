"""Calls to one named router replica: a Ray Serve request router for the router deployment.

``pdserve down`` must drain every router replica, and a Ray Serve handle sends each call to
any one of them. A call whose first argument is a ``ToReplica`` goes to the replica it names
(by the unique id of its ``ReplicaID``, the last part of its actor's name
``SERVE_REPLICA::<app>#<deployment>#<unique id>``), and waits while that replica is not
running. Every other call (each HTTP request, through Serve's proxy) is routed as Ray
Serve's default router does: the shorter queue of two random replicas, those on the
caller's node first.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ray.serve.request_router import FIFOMixin, LocalityMixin, PendingRequest, RequestRouter, RunningReplica

REPLICA_ACTOR_PREFIX = "SERVE_REPLICA::"


@dataclass(frozen=True)
class ToReplica:
    """The first argument of a call meant for one replica: its ReplicaID's ``unique_id``."""

    unique_id: str


def replica_ids(actor_names: list[str], app: str, deployment: str) -> list[str]:
    """The unique ids of a deployment's replicas, from Ray's named actors (their names)."""
    prefix = f"{REPLICA_ACTOR_PREFIX}{app}#{deployment}#"
    return sorted(name[len(prefix):] for name in actor_names if name.startswith(prefix))


class ReplicaTargetRouter(FIFOMixin, LocalityMixin, RequestRouter):
    """See the module doc."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        args = (pending_request.args if pending_request is not None else ()) or ()
        if args and isinstance(args[0], ToReplica):
            named = [r for r in candidate_replicas if r.replica_id.unique_id == args[0].unique_id]
            return [named] if named else []
        by_id = {r.replica_id: r for r in candidate_replicas}
        near = [by_id[i] for i in self.apply_locality_routing(pending_request=pending_request) if i in by_id] or candidate_replicas
        return [random.sample(near, min(2, len(near)))] if near else []
