from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FetchKVRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("transfer_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "num_tokens", "num_chunks")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    num_chunks: int
    def __init__(self, transfer_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer", "start_token", "num_tokens", "key", "value", "crc32")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    layer: int
    start_token: int
    num_tokens: int
    key: bytes
    value: bytes
    crc32: int
    def __init__(self, layer: _Optional[int] = ..., start_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class FetchKVResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    chunk: KVChunk
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
