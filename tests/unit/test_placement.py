"""Conditional disaggregation's decision (router/placement.py), without Ray."""

from router.placement import PrefillPlacement


def test_default_always_sends_prompts_to_the_prefill_pool():
    placement = PrefillPlacement()
    assert not placement.choose_local(1) and not placement.choose_local(5000)
    assert placement.stats.num_remote == 2


def test_short_prompts_prefill_on_decode():
    seen = []
    placement = PrefillPlacement(max_local_tokens=64, on_decision=seen.append)
    assert placement.choose_local(64) and not placement.choose_local(65)
    assert seen == ["local_short", "remote"]
    assert (placement.stats.num_local_short, placement.stats.num_remote) == (1, 1)


def test_a_long_prefill_queue_sends_prompts_to_decode_while_it_has_room():
    placement = PrefillPlacement(queue_s=1.0, max_local=1)
    ahead = placement.started(False, 500)  # the prefill pool is idle: this one measures its rate
    assert ahead == 0 and placement.prefill_wait_s() == 0.0  # no rate measured yet: no wait assumed
    placement.finished(False, 500, seconds=0.5, ahead=ahead)  # 1,000 tokens/s
    assert placement.tokens_per_s == 1000.0
    for _ in range(3):
        placement.started(False, 500)  # 1,500 tokens queued: 1.5 s of wait
    assert placement.prefill_wait_s() == 1.5
    assert placement.choose_local(200)
    placement.started(True, 200)
    assert not placement.choose_local(200)  # max_local reached: decode has no more room
    placement.finished(True, 200)
    assert placement.choose_local(200)
    assert (placement.stats.num_local_queued, placement.stats.num_remote) == (2, 1)


def test_a_queued_prefill_does_not_count_towards_the_measured_rate():
    placement = PrefillPlacement(queue_s=1.0)
    first = placement.started(False, 1000)
    second = placement.started(False, 1000)
    placement.finished(False, 1000, seconds=1.0, ahead=first)
    placement.finished(False, 1000, seconds=2.0, ahead=second)  # waited 1 s behind the first
    assert placement.tokens_per_s == 1000.0 and placement.remote_tokens == 0
    placement.finished(False, 0, seconds=None)  # a failed or cancelled call leaves the rate as it was
    assert placement.tokens_per_s == 1000.0
