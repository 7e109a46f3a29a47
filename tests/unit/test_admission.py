"""The router's admission control and authentication checks, without a cluster."""

import pytest

from pdserve.errors import AuthenticationError, CapacityError, RequestTooLargeError
from router.admission import Admission, QueueWatch, metadata_value


def test_admits_up_to_the_limit_then_refuses_with_the_hint_and_frees_on_release():
    a = Admission(max_in_flight=2, retry_after_s=0.5, max_request_bytes=1024, api_key=None)
    a.admit()
    a.admit()
    with pytest.raises(CapacityError, match="2 requests in flight") as info:
        a.admit()
    assert info.value.retry_after_s == 0.5 and a.stats() == {"num_in_flight": 2, "num_refused": 1, "num_refused_queue": 0}
    a.release()
    a.admit()
    assert a.stats() == {"num_in_flight": 2, "num_refused": 1, "num_refused_queue": 0}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_standing_queue_refuses_new_requests_at_once_and_a_drained_one_admits_again():
    clock = Clock()
    a = Admission(256, 1.0, 1024, None, max_queue_s=5.0, clock=clock)
    for i in range(20):  # a burst: all admitted, nothing has had a first token yet
        a.admit(f"r{i}")
    clock.now += 6.0
    for i in range(3):  # the queue's head gets its first tokens after 6 s
        a.decoding(f"r{i}")
    with pytest.raises(CapacityError, match=r"wait about 6.0 s to start decoding, more than router.max_queue_s \(5 s\)") as info:
        a.admit("late")
    assert info.value.retry_after_s == 1.0 and a.stats()["num_refused_queue"] == 1
    for i in range(3, 20):  # the queue drains (its tokens still slow), then ends
        clock.now += 0.5
        a.decoding(f"r{i}")
        a.release(f"r{i}")
    clock.now += 2.1  # nothing waits, no first token in the window: no queue
    a.admit("after")
    assert a.queue.queue_s() == 0.0


def test_one_long_prompt_among_quick_ones_does_not_trip_it():
    clock = Clock()
    q = QueueWatch(clock=clock)
    q.started("long")
    for i in range(10):
        q.started(f"s{i}")
        clock.now += 0.3
        q.decoding(f"s{i}")  # short prompts: decoding 0.3 s after arrival
    clock.now += 8.0
    q.decoding("long")  # 11 s
    assert q.queue_s() == 0.0  # alone in the window, and nothing waits: a late straggler does not shut the door
    q.started("s10")
    clock.now += 0.2
    q.started("s11")
    q.decoding("s10")
    assert q.queue_s() == pytest.approx(0.2)  # s11 waits: the least of the window counts


def test_a_drained_queue_opens_the_door_at_once():
    """A burst whose every request waited 11 s, then decoded and ended within the window:
    nothing waits now, so a new request would join no queue."""
    clock = Clock()
    q = QueueWatch(clock=clock)
    for i in range(3):
        q.started(f"r{i}")
    clock.now += 11.0
    for i in range(3):
        q.decoding(f"r{i}")
    q.started("next")
    assert q.queue_s() == pytest.approx(11.0)  # a standing queue, and one waits in it
    q.ended("next")
    for i in range(3):
        clock.now += 0.3
        q.ended(f"r{i}")
    assert q.queue_s() == 0.0  # the window still holds three 11 s waits, but nobody waits


def test_with_no_first_token_in_the_window_the_oldest_wait_counts():
    clock = Clock()
    q = QueueWatch(clock=clock)
    assert q.queue_s() == 0.0
    q.started("a")
    clock.now += 1.0
    q.started("b")
    clock.now += 3.0
    assert q.queue_s() == pytest.approx(4.0)
    q.ended("a")
    assert q.queue_s() == pytest.approx(3.0)


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer wrong", "Basic s3cret", "s3cret"])
def test_a_missing_or_wrong_key_is_refused(header):
    with pytest.raises(AuthenticationError, match="API key"):
        Admission(1, 1.0, 1024, api_key="s3cret").authenticate(header)


def test_the_right_key_passes_and_no_key_configured_means_open():
    Admission(1, 1.0, 1024, api_key="s3cret").authenticate("Bearer s3cret")
    Admission(1, 1.0, 1024, api_key="s3cret").authenticate("bearer  s3cret")
    Admission(1, 1.0, 1024, api_key=None).authenticate(None)


def test_size_limit_names_the_setting():
    a = Admission(1, 1.0, max_request_bytes=1024, api_key=None)
    a.check_size(1024)
    with pytest.raises(RequestTooLargeError, match="1025 bytes, more than router.max_request_bytes"):
        a.check_size(1025)


def test_metadata_lookup_is_case_insensitive():
    assert metadata_value([("Authorization", "Bearer k"), ("x", "y")], "authorization") == "Bearer k"
    assert metadata_value(None, "authorization") is None


def test_a_burst_is_refused_by_the_expected_wait_before_any_request_decodes():
    queued = [0.0]
    a = Admission(256, 1.0, 1024, None, max_queue_s=10.0, expected_wait_s=lambda: queued[0], clock=Clock())
    for i in range(11):  # the 11th sees 10 s ahead of it: not more than 10
        a.admit(f"b{i}")
        queued[0] += 1.0  # each admitted prompt adds a second of prefill ahead of the next
    with pytest.raises(CapacityError, match="wait about 11.0 s"):
        a.admit("b11")
    assert a.stats() == {"num_in_flight": 11, "num_refused": 1, "num_refused_queue": 1}
