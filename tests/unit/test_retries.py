"""router/retries.py: how many attempts a request stage gets, and how far apart."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.config import PoolConfig
from pdserve.errors import WorkerStalledError
from router.retries import Attempts, RetryPolicy


class Lost(Exception):
    pass


def test_a_lost_replica_is_retried_max_retries_times_with_doubling_backoff():
    attempts = Attempts(RetryPolicy(max_retries=2, backoff_s=0.05, exponential=True, stall_wait_s=1.0))

    async def run():
        waits = []
        for _ in range(2):
            start = time.monotonic()
            await attempts.before_retry(Lost())
            waits.append(time.monotonic() - start)
        with pytest.raises(Lost):
            await attempts.before_retry(Lost())
        return waits

    first, second = asyncio.run(run())
    assert 0.04 < first < second and second > 0.09


def test_stalled_replicas_are_retried_until_the_stall_wait_without_using_up_max_retries():
    attempts = Attempts(RetryPolicy(max_retries=0, backoff_s=0.05, exponential=False, stall_wait_s=0.4))

    async def run():
        start, tries = time.monotonic(), 0
        with pytest.raises(WorkerStalledError):
            while True:
                await attempts.before_retry(WorkerStalledError("stuck"))
                tries += 1
        return time.monotonic() - start, tries

    elapsed, tries = asyncio.run(run())
    assert 0.35 < elapsed < 1.0 and tries >= 4
    assert attempts.num_lost == 0


def test_the_stall_wait_covers_ray_serves_three_failed_health_checks():
    pool = PoolConfig(health_check_period_s=2.0, health_check_timeout_s=5.0)
    policy = RetryPolicy.for_pool(pool, max_retries=2, backoff_s=0.5, exponential=False)
    assert policy.stall_wait_s == 3 * 2.0 + 5.0


def test_a_resend_without_waiting_still_counts():
    attempts = Attempts(RetryPolicy(max_retries=1, backoff_s=10.0, exponential=False, stall_wait_s=1.0))

    async def run():
        start = time.monotonic()
        await attempts.before_retry(Lost(), wait=False)
        assert time.monotonic() - start < 0.5
        with pytest.raises(Lost):
            await attempts.before_retry(Lost(), wait=False)

    asyncio.run(run())
