"""grpc backend: KV bytes streamed over the KVTransfer service (any node to any node).

Wire format (proto/pdserve/rpc/kv.proto; chunks encoded by kv_transfer/wire.py): one
KVHeader (dtype, shape, block size, number of chunks), then one KVChunk per (layer, token
range), or per group of whole layers when a layer's KV is far below ``chunk_bytes`` (a
short prompt: gRPC costs ~0.2 ms per message here), each at most ``chunk_bytes`` of
key+value payload and protected by an XXH3-64 checksum (the xxhash library, ~20 GB/s
here against zlib CRC32's 2-4) that the receiver checks before use.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Callable

import torch
import xxhash

from kv_transfer.base import KVHandle, KVSink, KVSource
from pdserve.errors import KVTransferError
from pdserve.kv_layout import KVSpec
from kv_transfer.wire import ChunkView, encode_chunk
from pdserve.rpc import kv_pb2

# torch.frombuffer over protobuf's immutable bytes: we only ever copy out of it.
warnings.filterwarnings("ignore", message="The given buffer is not writable")

MAX_MESSAGE_BYTES = 64 << 20
# HTTP/2 frames of up to 16 MiB - 1 (RFC 9113's maximum) on both sides of the KV channel,
# instead of 16 KiB: a chunk then crosses in a few frames, not dozens; grpcio alone streamed
# 1 MiB messages at 1.1-1.4 GB/s with the default and 1.3-1.8 GB/s with this, here
FRAME_OPTIONS = [("grpc.http2.max_frame_size", (1 << 24) - 1)]


def _buffer(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, without a copy on the CPU (it must stay alive while the view is
    used); a GPU tensor is copied to the CPU first."""
    return memoryview(t.cpu().contiguous().view(torch.uint8).numpy()).cast("B")


def payload_checksum(key, value) -> int:
    """XXH3-64 of key then value; each a buffer or a list of buffers (taken in order)."""
    h = xxhash.xxh3_64()
    for part in (key, value):
        for piece in part if isinstance(part, list) else (part,):
            h.update(piece)
    return h.intdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def iter_chunks(transfer_id: str, source: KVSource, chunk_bytes: int, block_size: int = 0, corrupt: bool = False,
                deadline: float = math.inf, alive: Callable[[], bool] | None = None):
    """Yield the FetchKV stream of ``source``: a header (a message), then chunks of at most
    ``chunk_bytes`` (per layer and token range, or per group of whole layers for a short
    prompt), each already encoded (bytes, kv_transfer/wire.py).

    A source still being computed (``source.streamed``, kv_transfer/progress.py) is sent
    layer-wise: each chunk as soon as prefill has written it, then a KVTrailer with the
    first token. Waits end at ``deadline`` (time.monotonic()) or once ``alive()`` is false
    (the receiver left), raising KVNotReadyError. ``corrupt`` (fault injection): the first
    chunk goes out with one byte flipped after its checksum was taken."""
    spec, num_tokens = source.spec, source.num_tokens
    bytes_per_layer_token = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    tokens_per_chunk = max(1, chunk_bytes // bytes_per_layer_token)
    if block_size and tokens_per_chunk >= block_size:  # block-aligned chunks go out without a gather
        tokens_per_chunk -= tokens_per_chunk % block_size
    # a short prompt: several whole layers per chunk (fewer messages, each costs ~0.2 ms here);
    # not layer-wise, where each layer goes out as soon as it is written
    whole = tokens_per_chunk >= num_tokens and not source.streamed
    layers_per_chunk = max(1, chunk_bytes // (max(1, num_tokens) * bytes_per_layer_token)) if whole else 1
    starts = range(0, num_tokens, tokens_per_chunk)
    groups = range(0, spec.num_layers, layers_per_chunk)
    yield kv_pb2.FetchKVResponse(
        header=kv_pb2.KVHeader(
            transfer_id=transfer_id, dtype=dtype_name(spec.dtype), num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, num_tokens=num_tokens,
            num_chunks=len(groups) * len(starts), block_size=block_size, layerwise=source.streamed,
        )
    )
    for first in groups:
        layers = range(first, min(first + layers_per_chunk, spec.num_layers))
        for start in starts:
            end = min(start + tokens_per_chunk, num_tokens)
            source.wait_layer(layers[-1], end, deadline, alive)  # layer-wise: until prefill has written it ...
            with source.reading():  # ... and copied out before a preemption can free it
                key, value = [], []
                for layer in layers:
                    views = source.pieces(layer, start, end) if hasattr(source, "pieces") else None
                    if views is None:  # gathered: [kv_heads, n, head_dim] each
                        k, v = source.read(layer, start, end)
                        views = [_buffer(k)], [_buffer(v)]
                    key += views[0]  # straight from the pool's blocks: one copy, into the message
                    value += views[1]
                digest = payload_checksum(key, value)
                if corrupt:  # injected: one flipped byte after the checksum was taken
                    flat = b"".join(key)
                    key, corrupt = bytes([flat[0] ^ 0xFF]) + flat[1:], False
                message = encode_chunk(first, start, end - start, key, value, digest, len(layers))
            yield message
    if source.streamed:
        yield kv_pb2.FetchKVResponse(trailer=kv_pb2.KVTrailer(first_token=source.wait_first_token(deadline, alive)))


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
    """Write a FetchKV stream into ``sink``, checking every checksum; returns payload bytes.
    A layer-wise stream's first token goes to ``sink.first_token``.

    Raises KVTransferError on a bad header, chunk, checksum, a short stream or a cancel.
    """
    spec = sink.spec
    first = next(stream, None)
    if not isinstance(first, kv_pb2.FetchKVResponse) or not first.HasField("header"):
        raise KVTransferError("KV stream did not start with a header")
    header = first.header
    check_header(header, handle, spec)
    row_bytes = spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize  # one token of one layer, k or v
    num_chunks = nbytes = 0
    for msg in stream:
        if cancel is not None and cancel.is_set():
            raise KVTransferError("KV transfer cancelled")
        if not isinstance(msg, ChunkView) and msg.HasField("trailer"):  # layer-wise: prefill's first token ends it
            if not header.layerwise or num_chunks != header.num_chunks:
                raise KVTransferError(f"KV stream sent its trailer after {num_chunks} of {header.num_chunks} chunks")
            sink.first_token = msg.trailer.first_token
            continue
        chunk = msg if isinstance(msg, ChunkView) else msg.chunk
        if payload_checksum(chunk.key, chunk.value) != chunk.xxh3:
            raise KVTransferError(f"KV chunk (layer {chunk.layer}, token {chunk.start_token}) failed its checksum")
        end, num_layers = chunk.start_token + chunk.num_tokens, max(1, chunk.num_layers)
        if chunk.layer + num_layers > spec.num_layers or end > handle.num_tokens:
            raise KVTransferError(f"KV chunk (layers {chunk.layer}+{num_layers}, tokens {chunk.start_token}:{end}) is out of range")
        expected = num_layers * chunk.num_tokens * row_bytes
        if len(chunk.key) != expected or len(chunk.value) != expected:
            raise KVTransferError(f"KV chunk (layer {chunk.layer}) has {len(chunk.key)} bytes, expected {expected}")
        shape = (num_layers, spec.num_kv_heads, chunk.num_tokens, spec.head_dim)
        k = torch.frombuffer(chunk.key, dtype=spec.dtype).view(shape)  # [layers, kv_heads, n, head_dim]
        v = torch.frombuffer(chunk.value, dtype=spec.dtype).view(shape)
        for i in range(num_layers):
            sink.write(chunk.layer + i, chunk.start_token, k[i], v[i])
        num_chunks += 1
        nbytes += 2 * expected
    if num_chunks != header.num_chunks:
        raise KVTransferError(f"KV stream ended after {num_chunks} of {header.num_chunks} chunks")
    if header.layerwise and sink.first_token is None:
        raise KVTransferError("layer-wise KV stream ended without its trailer (the first token)")
    return nbytes
