"""The router's admission control and authentication checks, without a cluster."""

import pytest

from pdserve.errors import AuthenticationError, CapacityError, RequestTooLargeError
from router.admission import Admission, metadata_value


def test_admits_up_to_the_limit_then_refuses_with_the_hint_and_frees_on_release():
    a = Admission(max_in_flight=2, retry_after_s=0.5, max_request_bytes=1024, api_key=None)
    a.admit()
    a.admit()
    with pytest.raises(CapacityError, match="2 requests in flight") as info:
        a.admit()
    assert info.value.retry_after_s == 0.5 and a.stats() == {"num_in_flight": 2, "num_refused": 1}
    a.release()
    a.admit()
    assert a.stats() == {"num_in_flight": 2, "num_refused": 1}


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
