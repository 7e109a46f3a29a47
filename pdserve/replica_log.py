"""pdserve's own log lines in a replica's Ray Serve log.

Ray Serve writes a replica's log (``/tmp/ray/session_latest/logs/serve/replica_*.log``) through
the ``ray.serve`` logger only, which does not propagate; other loggers reach the root logger,
whose level (WARNING) drops their INFO lines: which dtype and weights a pool loaded, its KV
pool, its torch threads. ``to_replica_log`` hands pdserve's loggers the replica's handlers.
"""

from __future__ import annotations

import logging

PACKAGES = ("pdserve", "router", "prefill_worker", "decode_worker", "kv_transfer")


def to_replica_log(level: int = logging.INFO) -> None:
    """Inside a Ray Serve replica: pdserve's loggers (``PACKAGES``) log at ``level`` and up into
    the replica's Serve log, and not also to the root logger (Serve sends stderr there too, so a
    warning would appear twice). Outside a replica (tests, a worker built in-process) it does
    nothing, so those records still propagate to the root logger as usual."""
    try:
        from ray import serve

        serve.get_replica_context()
    except Exception:  # noqa: BLE001 - not in a replica (RayServeException), or no Ray
        return
    handlers = logging.getLogger("ray.serve").handlers
    if not handlers:
        return
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for handler in handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = False
