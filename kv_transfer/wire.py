"""Protobuf wire encoding of the FetchKV stream's chunks, without intermediate copies.

A ``KVChunk`` (proto/pdserve/rpc/kv.proto) carries up to ``chunk_bytes`` of KV. Built the
usual way its payload is copied three times on the sender (tensor -> bytes -> message ->
serialized) and twice on the receiver; here each chunk is encoded straight from the
tensors' memory into one bytes object (one copy), and decoded into memoryviews of the
received bytes (no copy). The bytes are standard protobuf: ``FetchKVResponse.FromString``
parses them too (tests/unit/test_kv_transfer.py checks both ways).

Protobuf encoding: https://protobuf.dev/programming-guides/encoding/
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from pdserve.rpc import kv_pb2

_VARINT, _FIXED64, _LEN = 0, 1, 2


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def encode_chunk(layer: int, start_token: int, num_tokens: int, key, value, xxh3: int, num_layers: int = 1) -> bytes:
    """A serialized ``FetchKVResponse{chunk: KVChunk{...}}``. key, value: a buffer (bytes,
    memoryview) or a list of buffers whose concatenation is the field's bytes."""
    key = key if isinstance(key, list) else [key]
    value = value if isinstance(value, list) else [value]
    key_len, value_len = sum(memoryview(p).nbytes for p in key), sum(memoryview(p).nbytes for p in value)
    head = b"".join([_tag(1, _VARINT), _varint(layer), _tag(2, _VARINT), _varint(start_token),
                     _tag(3, _VARINT), _varint(num_tokens), _tag(4, _LEN), _varint(key_len)])
    mid = _tag(5, _LEN) + _varint(value_len)
    tail = _tag(7, _FIXED64) + struct.pack("<Q", xxh3) + (_tag(8, _VARINT) + _varint(num_layers) if num_layers > 1 else b"")
    body_len = len(head) + key_len + len(mid) + value_len + len(tail)
    return b"".join([_tag(2, _LEN), _varint(body_len), head, *key, mid, *value, tail])


@dataclass
class ChunkView:
    """A decoded KVChunk whose key and value are views into the received bytes."""

    layer: int = 0
    start_token: int = 0
    num_tokens: int = 0
    num_layers: int = 0  # 0 means 1
    key: memoryview = memoryview(b"")
    value: memoryview = memoryview(b"")
    xxh3: int = 0


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def decode_response(data: bytes) -> kv_pb2.FetchKVResponse | ChunkView:
    """Parse one FetchKV message: a ChunkView for a chunk, the protobuf message otherwise.
    Raises ValueError on malformed bytes."""
    buf = memoryview(data)
    try:
        tag, pos = _read_varint(buf, 0)
        if tag != (2 << 3 | _LEN):  # not a chunk (the header): the regular parser
            return kv_pb2.FetchKVResponse.FromString(data)
        length, pos = _read_varint(buf, pos)
        end, chunk = pos + length, ChunkView()
        while pos < end:
            tag, pos = _read_varint(buf, pos)
            field, wire_type = tag >> 3, tag & 7
            if wire_type == _VARINT:
                value, pos = _read_varint(buf, pos)
                if field in (1, 2, 3):
                    setattr(chunk, ("layer", "start_token", "num_tokens")[field - 1], value)
                elif field == 8:
                    chunk.num_layers = value
            elif wire_type == _FIXED64:
                if field == 7:
                    chunk.xxh3 = struct.unpack_from("<Q", buf, pos)[0]
                pos += 8
            elif wire_type == _LEN:
                size, pos = _read_varint(buf, pos)
                if field == 4:
                    chunk.key = buf[pos : pos + size]
                elif field == 5:
                    chunk.value = buf[pos : pos + size]
                pos += size
            elif wire_type == 5:  # fixed32
                pos += 4
            else:
                raise ValueError(f"unexpected wire type {wire_type}")
        if pos != end:
            raise ValueError("chunk length mismatch")
        return chunk
    except (IndexError, struct.error) as e:
        raise ValueError(f"malformed KV chunk: {e}") from None


def serialize_response(message) -> bytes:
    """FetchKV's response serializer: pre-encoded chunks pass through, messages serialize."""
    return message if isinstance(message, bytes) else message.SerializeToString()
