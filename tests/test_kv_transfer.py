"""KV transfer over real gRPC on loopback: round trip, leases, faults, layout checks."""

import time
from concurrent import futures

import grpc
import pytest
import torch

from kv_transfer.base import KVHandle, TensorKVSink, TensorKVSource
from kv_transfer.grpc_backend import GrpcKVReceiver, GrpcKVSender, _KVServicer, iter_chunks
from kv_transfer.lease import LeaseTable
from pdserve.errors import KVNotFoundError, KVTransferError
from pdserve.kv_layout import KVSpec
from pdserve.rpc import kv_pb2_grpc

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32)


def random_kv(spec: KVSpec, num_tokens: int) -> TensorKVSource:
    """kv: [num_layers, 2, kv_heads, num_tokens, head_dim]"""
    shape = (spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim)
    return TensorKVSource(torch.randn(shape).to(spec.dtype))


def fetch(receiver, handle, spec, timeout_s=10):
    sink = TensorKVSink(spec, handle.num_tokens)
    receiver.fetch(handle, sink, timeout_s)
    return sink.kv


@pytest.fixture
def sender():
    s = GrpcKVSender("127.0.0.1", chunk_bytes=1024)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 17, 300])
def test_round_trip_is_bit_exact_and_released(dtype, num_tokens):
    spec = KVSpec(3, 2, 8, dtype)
    sender = GrpcKVSender("127.0.0.1", chunk_bytes=1024)  # small chunks: many per layer
    receiver = GrpcKVReceiver()
    try:
        source = random_kv(spec, num_tokens)
        handle = sender.put("req-1", source, lease_s=30)
        got = fetch(receiver, handle, spec)
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), source.kv.view(torch.uint8))
        assert sender.stats()["num_held"] == 1
        assert receiver.release(handle, timeout_s=5) is True
        assert sender.stats() == {"num_held": 0, "bytes_held": 0, "num_released": 1, "num_expired": 0}
        with pytest.raises(KVNotFoundError):
            fetch(receiver, handle, spec)
        assert receiver.release(handle, timeout_s=5) is False
    finally:
        receiver.close()
        sender.close()


def test_chunks_respect_the_byte_budget():
    messages = list(iter_chunks("x", random_kv(SPEC, 100), chunk_bytes=1024))
    header, chunks = messages[0].header, [m.chunk for m in messages[1:]]
    assert header.num_chunks == len(chunks) > SPEC.num_layers
    assert all(len(c.key) + len(c.value) <= 1024 for c in chunks)
    assert sum(c.num_tokens for c in chunks) == 100 * SPEC.num_layers


def test_lease_expires_and_frees(sender):
    receiver = GrpcKVReceiver()
    handle = sender.put("req-2", random_kv(SPEC, 5), lease_s=0.2)
    time.sleep(1.0)  # the reaper runs every 0.5 s
    assert sender.stats()["num_held"] == 0 and sender.stats()["num_expired"] == 1
    with pytest.raises(KVNotFoundError, match="released or lease expired"):
        fetch(receiver, handle, SPEC)
    receiver.close()


def test_lease_table_refuses_a_duplicate_id():
    table = LeaseTable()
    table.hold("a", random_kv(SPEC, 1), 10)
    with pytest.raises(KeyError):
        table.hold("a", random_kv(SPEC, 1), 10)
    table.close()


@pytest.mark.parametrize(
    "field, spec",
    [
        ("num_layers", KVSpec(4, 2, 8, torch.float32)),
        ("num_kv_heads", KVSpec(3, 1, 8, torch.float32)),
        ("head_dim", KVSpec(3, 2, 16, torch.float32)),
        ("dtype", KVSpec(3, 2, 8, torch.bfloat16)),
    ],
)
def test_layout_mismatch_names_the_field(sender, field, spec):
    handle = sender.put("req-3", random_kv(SPEC, 4), lease_s=30)
    receiver = GrpcKVReceiver()
    with pytest.raises(KVTransferError, match=field):
        fetch(receiver, handle, spec)
    receiver.close()


class _CorruptingServicer(_KVServicer):
    """Flips one payload byte after the CRC was computed (a fault injected on the wire)."""

    def FetchKV(self, request, context):
        for i, msg in enumerate(super().FetchKV(request, context)):
            if i == 2:
                value = bytearray(msg.chunk.value)
                value[0] ^= 0xFF
                msg.chunk.value = bytes(value)
            yield msg


def test_checksum_failure_is_detected():
    table = LeaseTable()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    kv_pb2_grpc.add_KVTransferServicer_to_server(_CorruptingServicer(table, 1024), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        table.hold("req-4", random_kv(SPEC, 50), 30)
        receiver = GrpcKVReceiver()
        with pytest.raises(KVTransferError, match="checksum"):
            fetch(receiver, KVHandle("grpc", f"127.0.0.1:{port}", "req-4", 50), SPEC)
        receiver.close()
    finally:
        server.stop(None)
        table.close()


def test_unreachable_sender_is_a_transfer_error():
    receiver = GrpcKVReceiver()
    with pytest.raises(KVTransferError, match="UNAVAILABLE|DEADLINE"):
        fetch(receiver, KVHandle("grpc", "127.0.0.1:1", "nope", 4), SPEC, timeout_s=2)
    receiver.close()
