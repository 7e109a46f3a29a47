"""How often, and how far apart, the router sends one stage of a request (prefill, or the
decode stream) again after its replica was lost.

Two kinds of loss:

- The replica died (Ray actor error; or, layer-wise, the KV stream broke before the first
  token). Ray Serve drops a dead replica from routing at once, so the next attempt goes
  elsewhere: up to ``max_retries`` attempts, ``backoff_s`` x 2^k apart (prefill) or
  ``backoff_s`` apart (decode migrations).
- The replica is alive but its engine is stuck in a step (WorkerStalledError, after the
  pool's ``max_step_s``). It answers every call at once with that error until Ray Serve
  takes it out of routing, which happens after 3 failed health checks, i.e. within
  ``3 x health_check_period_s + health_check_timeout_s``. Meanwhile Ray Serve may keep
  picking it, so attempts after a stall are not counted against ``max_retries``: they go
  on ``backoff_s`` apart until ``stall_wait_s`` has passed since the first stall.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from pdserve.config import PoolConfig
from pdserve.errors import WorkerStalledError

HEALTH_CHECK_FAILURES = 3  # failed checks in a row before Ray Serve replaces a replica (REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD)


@dataclass(frozen=True)
class RetryPolicy:
    max_retries: int  # attempts after a lost replica, per stage
    backoff_s: float  # seconds before the first of them
    exponential: bool  # double the wait after each lost replica
    stall_wait_s: float  # seconds of attempts after a stalled replica (see the module docstring)

    @classmethod
    def for_pool(cls, pool: PoolConfig, max_retries: int, backoff_s: float, exponential: bool) -> "RetryPolicy":
        stall_wait_s = HEALTH_CHECK_FAILURES * pool.health_check_period_s + pool.health_check_timeout_s
        return cls(max_retries, backoff_s, exponential, stall_wait_s)


class Attempts:
    """The retries of one stage of one request under ``policy``."""

    def __init__(self, policy: RetryPolicy):
        self.policy = policy
        self.num_lost = 0
        self._stall_deadline: float | None = None  # time.monotonic() after which a stall is final

    async def before_retry(self, error: BaseException, wait: bool = True) -> None:
        """Wait before the next attempt (unless ``wait`` is false); re-raise ``error`` if
        the stage has no attempt left."""
        if isinstance(error, WorkerStalledError):
            now = time.monotonic()
            if self._stall_deadline is None:
                self._stall_deadline = now + self.policy.stall_wait_s
            if now >= self._stall_deadline:
                raise error
            await asyncio.sleep(min(max(self.policy.backoff_s, 0.1), self._stall_deadline - now))
            return
        if self.num_lost == self.policy.max_retries:
            raise error
        self.num_lost += 1
        if wait:
            await asyncio.sleep(self.policy.backoff_s * (2 ** (self.num_lost - 1) if self.policy.exponential else 1))
