"""gRPC backend: the prefill worker runs a KVTransfer server, decode workers fetch from it.

Wire format (proto/pdserve/rpc/kv.proto): one KVHeader, then one KVChunk per
(layer, token range), each at most ``chunk_bytes`` of key+value payload and
protected by a CRC32.
"""

from __future__ import annotations

import threading
import warnings
import zlib
from concurrent import futures

import grpc
import torch

from kv_transfer.base import KVHandle, KVReceiver, KVSender, KVSink, KVSource
from kv_transfer.lease import LeaseTable
from pdserve.errors import KVNotFoundError, KVTransferError
from pdserve.kv_layout import KVSpec
from pdserve.rpc import kv_pb2, kv_pb2_grpc

# torch.frombuffer over protobuf's immutable bytes: we only ever copy out of it.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

_MAX_MESSAGE_BYTES = 64 << 20


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def iter_chunks(transfer_id: str, source: KVSource, chunk_bytes: int):
    """Yield the FetchKV stream of ``source``: a header, then per layer chunks of at most ``chunk_bytes``."""
    spec, num_tokens = source.spec, source.num_tokens
    bytes_per_layer_token = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    tokens_per_chunk = max(1, chunk_bytes // bytes_per_layer_token)
    starts = range(0, num_tokens, tokens_per_chunk)
    yield kv_pb2.FetchKVResponse(
        header=kv_pb2.KVHeader(
            transfer_id=transfer_id,
            dtype=str(spec.dtype).removeprefix("torch."),
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            num_tokens=num_tokens,
            num_chunks=spec.num_layers * len(starts),
        )
    )
    for layer in range(spec.num_layers):
        for start in starts:
            end = min(start + tokens_per_chunk, num_tokens)
            k, v = source.read(layer, start, end)  # each [kv_heads, n, head_dim]
            key, value = _to_bytes(k), _to_bytes(v)
            yield kv_pb2.FetchKVResponse(
                chunk=kv_pb2.KVChunk(
                    layer=layer, start_token=start, num_tokens=end - start,
                    key=key, value=value, crc32=zlib.crc32(value, zlib.crc32(key)),
                )
            )


class _KVServicer(kv_pb2_grpc.KVTransferServicer):
    def __init__(self, table: LeaseTable, chunk_bytes: int):
        self.table = table
        self.chunk_bytes = chunk_bytes

    def FetchKV(self, request, context):
        source = self.table.get(request.transfer_id)
        if source is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no KV held for transfer {request.transfer_id!r} (released or lease expired)")
        yield from iter_chunks(request.transfer_id, source, self.chunk_bytes)

    def ReleaseKV(self, request, context):
        return kv_pb2.ReleaseKVResponse(released=self.table.release(request.transfer_id))


class GrpcKVSender(KVSender):
    """Serves held KV on ``bind_host`` at a free port (``self.address``)."""

    def __init__(self, bind_host: str, chunk_bytes: int, max_workers: int = 8):
        self.table = LeaseTable()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-server"),
            options=[("grpc.max_send_message_length", _MAX_MESSAGE_BYTES)],
        )
        kv_pb2_grpc.add_KVTransferServicer_to_server(_KVServicer(self.table, chunk_bytes), self._server)
        port = self._server.add_insecure_port(f"{bind_host}:0")
        if port == 0:
            raise OSError(f"cannot bind the KV server to {bind_host}")
        self.address = f"{bind_host}:{port}"
        self._server.start()

    def put(self, transfer_id: str, source: KVSource, lease_s: float) -> KVHandle:
        self.table.hold(transfer_id, source, lease_s)
        return KVHandle("grpc", self.address, transfer_id, source.num_tokens)

    def release(self, transfer_id: str) -> bool:
        return self.table.release(transfer_id)

    def stats(self) -> dict[str, int]:
        return self.table.stats()

    def close(self) -> None:
        self._server.stop(grace=None)
        self.table.close()


class GrpcKVReceiver(KVReceiver):
    """Fetches KV over gRPC into a KVSink; one channel per sender."""

    def __init__(self):
        self._stubs: dict[str, kv_pb2_grpc.KVTransferStub] = {}
        self._channels: list[grpc.Channel] = []
        self._lock = threading.Lock()

    def _stub(self, address: str) -> kv_pb2_grpc.KVTransferStub:
        with self._lock:
            if address not in self._stubs:
                channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)])
                self._channels.append(channel)
                self._stubs[address] = kv_pb2_grpc.KVTransferStub(channel)
            return self._stubs[address]

    @staticmethod
    def _check_header(header, handle: KVHandle, spec: KVSpec) -> None:
        expected = {
            "dtype": str(spec.dtype).removeprefix("torch."),
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "num_tokens": handle.num_tokens,
        }
        for name, want in expected.items():
            got = getattr(header, name)
            if got != want:
                raise KVTransferError(f"KV from {handle.address} has {name}={got}, this decode worker needs {want}")

    def fetch(self, handle: KVHandle, sink: KVSink, timeout_s: float) -> None:
        spec = sink.spec
        stream = self._stub(handle.address).FetchKV(kv_pb2.FetchKVRequest(transfer_id=handle.transfer_id), timeout=timeout_s)
        try:
            first = next(stream)
            if not first.HasField("header"):
                raise KVTransferError("KV stream did not start with a header")
            header = first.header
            self._check_header(header, handle, spec)
            row_bytes = spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize  # one token of one layer, k or v
            num_chunks = 0
            for msg in stream:
                chunk = msg.chunk
                if zlib.crc32(chunk.value, zlib.crc32(chunk.key)) != chunk.crc32:
                    raise KVTransferError(f"KV chunk (layer {chunk.layer}, token {chunk.start_token}) failed its checksum")
                end = chunk.start_token + chunk.num_tokens
                if chunk.layer >= spec.num_layers or end > handle.num_tokens:
                    raise KVTransferError(f"KV chunk (layer {chunk.layer}, tokens {chunk.start_token}:{end}) is out of range")
                expected = chunk.num_tokens * row_bytes
                if len(chunk.key) != expected or len(chunk.value) != expected:
                    raise KVTransferError(f"KV chunk (layer {chunk.layer}) has {len(chunk.key)} bytes, expected {expected}")
                shape = (spec.num_kv_heads, chunk.num_tokens, spec.head_dim)
                k = torch.frombuffer(chunk.key, dtype=spec.dtype).view(shape)  # [kv_heads, n, head_dim]
                v = torch.frombuffer(chunk.value, dtype=spec.dtype).view(shape)
                sink.write(chunk.layer, chunk.start_token, k, v)
                num_chunks += 1
            if num_chunks != header.num_chunks:
                raise KVTransferError(f"KV stream ended after {num_chunks} of {header.num_chunks} chunks")
        except StopIteration:
            raise KVTransferError("KV stream ended before its header") from None
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                raise KVNotFoundError(e.details()) from None
            raise KVTransferError(f"KV fetch from {handle.address} failed: {e.code().name}: {e.details()}") from None
        finally:
            stream.cancel()

    def release(self, handle: KVHandle, timeout_s: float) -> bool:
        try:
            reply = self._stub(handle.address).ReleaseKV(kv_pb2.ReleaseKVRequest(transfer_id=handle.transfer_id), timeout=timeout_s)
        except grpc.RpcError as e:
            raise KVTransferError(f"KV release at {handle.address} failed: {e.code().name}: {e.details()}") from None
        return reply.released

    def close(self) -> None:
        with self._lock:
            for channel in self._channels:
                channel.close()
            self._channels.clear()
            self._stubs.clear()
