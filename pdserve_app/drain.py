"""``pdserve down``'s drain, run in a child process (joining a cluster whose head is gone can
wait for minutes): ``python -m pdserve_app.drain DRAIN_S`` drains every router replica of
the app at once (router/draining.py) and prints one JSON line: the replicas' summed counts
({"replicas", "in_flight", "finished", "cut", "left", "unanswered"}).

Exit status: 0 drained, 3 no Ray cluster or no pdserve app running, 1 an error.
"""

from __future__ import annotations

import json
import sys

ANSWER_SLACK_S = 30.0  # beyond the drain and its close deadline, the longest wait for a replica's answer


def drain_all(drain_s: float) -> dict[str, int]:
    """Drain each router replica (in parallel); returns the summed counts. Raises
    LookupError if no pdserve app runs."""
    import ray
    from ray import serve

    from pdserve_app.deploy import APP_NAME, ROUTER_DEPLOYMENT
    from router.draining import CLOSE_DEADLINE_S
    from router.replica_calls import ToReplica, replica_ids

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    ids = replica_ids(names, APP_NAME, ROUTER_DEPLOYMENT)
    if not ids:
        raise LookupError(f"no replica of the {APP_NAME} app's {ROUTER_DEPLOYMENT} deployment is running")
    handle = serve.get_deployment_handle(ROUTER_DEPLOYMENT, APP_NAME)
    calls = [handle.drain.remote(ToReplica(i), drain_s) for i in ids]
    total = {"replicas": len(ids), "in_flight": 0, "finished": 0, "cut": 0, "left": 0, "unanswered": 0}
    for call in calls:
        try:
            counts = call.result(timeout_s=drain_s + CLOSE_DEADLINE_S + ANSWER_SLACK_S)
        except Exception:  # noqa: BLE001 - a replica that died or hangs: Serve's shutdown stops it
            total["unanswered"] += 1
            continue
        for key in ("in_flight", "finished", "cut", "left"):
            total[key] += counts[key]
    return total


def main(argv: list[str]) -> int:
    import ray

    drain_s = float(argv[1]) if len(argv) > 1 else 30.0
    try:
        ray.init(address="auto", log_to_driver=False)
    except ConnectionError:
        return 3
    try:
        print(json.dumps(drain_all(drain_s)))
    except LookupError:
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
