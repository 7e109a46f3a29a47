"""router/retries.py: how many attempts a request stage gets, and how far apart.

The waits are read off a fake clock (``clock`` below): retries.py's ``time.monotonic`` and
``asyncio.sleep`` replaced, each sleep recorded and the clock moved by it, so the tests check
the exact sequence of delays, not a wall-clock measurement."""

from __future__ import annotations

import asyncio
import types

import pytest

from pdserve.config import PoolConfig
from pdserve.errors import WorkerStalledError
from router import retries
from router.retries import Attempts, RetryPolicy


class Lost(Exception):
    pass


class FakeClock:
    """A monotonic clock that only ``sleep`` moves; ``sleeps``: every delay asked for."""

    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, delay: float) -> None:
        self.sleeps.append(delay)
        self.now += delay


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(retries, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    monkeypatch.setattr(retries, "asyncio", types.SimpleNamespace(sleep=clock.sleep))
    return clock


def test_a_lost_replica_is_retried_max_retries_times_with_doubling_backoff(clock):
    attempts = Attempts(RetryPolicy(max_retries=2, backoff_s=0.05, exponential=True, stall_wait_s=1.0))

    async def run():
        for _ in range(2):
            await attempts.before_retry(Lost())
        with pytest.raises(Lost):
            await attempts.before_retry(Lost())

    asyncio.run(run())
    assert clock.sleeps == [0.05, 0.1]  # backoff_s, then doubled; none before the re-raise
    assert attempts.num_lost == 2


def test_stalled_replicas_are_retried_until_the_stall_wait_without_using_up_max_retries(clock):
    attempts = Attempts(RetryPolicy(max_retries=0, backoff_s=0.05, exponential=False, stall_wait_s=0.45))

    async def run():
        tries = 0
        with pytest.raises(WorkerStalledError):
            while True:
                await attempts.before_retry(WorkerStalledError("stuck"))
                tries += 1
        return tries

    tries = asyncio.run(run())
    # backoff_s raised to the 0.1 s floor, the last wait cut to end at the stall wait, then the error
    assert tries == 5 and clock.sleeps == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.05])
    assert clock.now == pytest.approx(0.45)
    assert attempts.num_lost == 0


def test_the_stall_wait_covers_ray_serves_three_failed_health_checks():
    pool = PoolConfig(health_check_period_s=2.0, health_check_timeout_s=5.0)
    policy = RetryPolicy.for_pool(pool, max_retries=2, backoff_s=0.5, exponential=False)
    assert policy.stall_wait_s == 3 * 2.0 + 5.0


def test_a_resend_without_waiting_still_counts(clock):
    attempts = Attempts(RetryPolicy(max_retries=1, backoff_s=10.0, exponential=False, stall_wait_s=1.0))

    async def run():
        await attempts.before_retry(Lost(), wait=False)
        assert clock.sleeps == [] and attempts.num_lost == 1  # no wait, but the attempt is spent
        with pytest.raises(Lost):
            await attempts.before_retry(Lost(), wait=False)

    asyncio.run(run())
    assert clock.sleeps == []
