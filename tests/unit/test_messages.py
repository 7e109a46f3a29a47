"""The decode pool's request kinds (pdserve/messages.py): one type each, told apart by type,
not by which fields are None."""

import dataclasses

from pdserve.messages import FreshRequest, KVHandle, LayerwiseKV, Migrated, WithKV
from pdserve.sampling import SamplingParams

P, H = SamplingParams(), KVHandle("grpc", "127.0.0.1:1", "t", 3)


def test_each_kind_carries_only_what_it_needs():
    fields = lambda cls: [f.name for f in dataclasses.fields(cls)]  # noqa: E731
    common = ["request_id", "prompt_ids", "params", "caller", "choices"]  # keyword-only: caller (pdserve/callers.py), choices (n > 1)
    assert fields(FreshRequest) == common
    assert fields(WithKV) == [*common, "first_token", "kv"]
    assert fields(LayerwiseKV) == [*common, "kv"]
    assert fields(Migrated) == [*common, "streamed"]


def test_the_kinds_are_distinct_types():
    kinds = [FreshRequest("r", [1], P), WithKV("r", [1], P, 7, H), LayerwiseKV("r", [1], P, H), Migrated("r", [1], P, (7, 8))]
    matched = []
    for request in kinds:
        match request:
            case WithKV():
                matched.append("kv")
            case LayerwiseKV():
                matched.append("layerwise")
            case Migrated():
                matched.append("migrated")
            case FreshRequest():
                matched.append("fresh")
    assert matched == ["fresh", "kv", "layerwise", "migrated"]
