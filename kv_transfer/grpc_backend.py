"""grpc backend: KV bytes streamed over the KVTransfer service (any node to any node).

Wire format (proto/pdserve/rpc/kv.proto): one KVHeader (dtype, shape, block size, number
of chunks), then one KVChunk per (layer, token range), each at most ``chunk_bytes`` of
key+value payload and protected by a CRC32 (zlib) that the receiver checks before use.
"""

from __future__ import annotations

import threading
import warnings
import zlib

import torch

from kv_transfer.base import KVHandle, KVSink, KVSource
from kv_transfer.faults import FaultInjector
from pdserve.errors import KVTransferError
from pdserve.kv_layout import KVSpec
from pdserve.rpc import kv_pb2

# torch.frombuffer over protobuf's immutable bytes: we only ever copy out of it.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

MAX_MESSAGE_BYTES = 64 << 20


def _to_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def iter_chunks(transfer_id: str, source: KVSource, chunk_bytes: int, block_size: int = 0, faults: FaultInjector | None = None):
    """Yield the FetchKV stream of ``source``: a header, then per layer chunks of at most ``chunk_bytes``."""
    spec, num_tokens = source.spec, source.num_tokens
    bytes_per_layer_token = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    tokens_per_chunk = max(1, chunk_bytes // bytes_per_layer_token)
    starts = range(0, num_tokens, tokens_per_chunk)
    corrupt = faults is not None and faults.take("corrupt")
    yield kv_pb2.FetchKVResponse(
        header=kv_pb2.KVHeader(
            transfer_id=transfer_id, dtype=dtype_name(spec.dtype), num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, num_tokens=num_tokens,
            num_chunks=spec.num_layers * len(starts), block_size=block_size,
        )
    )
    for layer in range(spec.num_layers):
        for start in starts:
            end = min(start + tokens_per_chunk, num_tokens)
            k, v = source.read(layer, start, end)  # each [kv_heads, n, head_dim]
            key, value = _to_bytes(k), _to_bytes(v)
            crc = zlib.crc32(value, zlib.crc32(key))
            if corrupt:  # injected: one flipped byte after the checksum was taken
                key, corrupt = bytes([key[0] ^ 0xFF]) + key[1:], False
            yield kv_pb2.FetchKVResponse(
                chunk=kv_pb2.KVChunk(layer=layer, start_token=start, num_tokens=end - start, key=key, value=value, crc32=crc)
            )


def check_header(header, handle: KVHandle, spec: KVSpec) -> None:
    """Raises KVTransferError naming the first field of the stream's header that does not fit."""
    expected = {
        "dtype": dtype_name(spec.dtype), "num_layers": spec.num_layers, "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "num_tokens": handle.num_tokens,
    }
    for name, want in expected.items():
        got = getattr(header, name)
        if got != want:
            raise KVTransferError(f"KV from {handle.address} has {name}={got}, this decode worker needs {want}")


def receive_stream(stream, handle: KVHandle, sink: KVSink, cancel: threading.Event | None) -> int:
    """Write a FetchKV stream into ``sink``, checking every CRC; returns payload bytes.

    Raises KVTransferError on a bad header, chunk, checksum, a short stream or a cancel.
    """
    spec = sink.spec
    first = next(stream, None)
    if first is None or not first.HasField("header"):
        raise KVTransferError("KV stream did not start with a header")
    header = first.header
    check_header(header, handle, spec)
    row_bytes = spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize  # one token of one layer, k or v
    num_chunks = nbytes = 0
    for msg in stream:
        if cancel is not None and cancel.is_set():
            raise KVTransferError("KV transfer cancelled")
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
        nbytes += 2 * expected
    if num_chunks != header.num_chunks:
        raise KVTransferError(f"KV stream ended after {num_chunks} of {header.num_chunks} chunks")
    return nbytes
