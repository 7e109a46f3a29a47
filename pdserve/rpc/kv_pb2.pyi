from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVFingerprint(_message.Message):
    __slots__ = ("model_id", "weights_hash", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "tokenizer_hash")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_HASH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_hash: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tokenizer_hash: str
    def __init__(self, model_id: _Optional[str] = ..., weights_hash: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., tokenizer_hash: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("fingerprint",)
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: KVFingerprint
    def __init__(self, fingerprint: _Optional[_Union[KVFingerprint, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("fingerprint", "instance_id")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    fingerprint: KVFingerprint
    instance_id: str
    def __init__(self, fingerprint: _Optional[_Union[KVFingerprint, _Mapping]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class DescribeKVRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class DescribeKVResponse(_message.Message):
    __slots__ = ("shm_path", "pool_num_blocks", "block_ids", "num_tokens", "block_size", "layerwise", "first_token", "cuda_ipc_k", "cuda_ipc_v")
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    POOL_NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_K_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_V_FIELD_NUMBER: _ClassVar[int]
    shm_path: str
    pool_num_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    block_size: int
    layerwise: bool
    first_token: int
    cuda_ipc_k: bytes
    cuda_ipc_v: bytes
    def __init__(self, shm_path: _Optional[str] = ..., pool_num_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., layerwise: _Optional[bool] = ..., first_token: _Optional[int] = ..., cuda_ipc_k: _Optional[bytes] = ..., cuda_ipc_v: _Optional[bytes] = ...) -> None: ...

class FetchKVRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    def __init__(self, transfer_id: _Optional[str] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("transfer_id", "dtype", "num_layers", "num_kv_heads", "head_dim", "num_tokens", "num_chunks", "block_size", "layerwise")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYERWISE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tokens: int
    num_chunks: int
    block_size: int
    layerwise: bool
    def __init__(self, transfer_id: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., block_size: _Optional[int] = ..., layerwise: _Optional[bool] = ...) -> None: ...

class KVTrailer(_message.Message):
    __slots__ = ("first_token",)
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    def __init__(self, first_token: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer", "start_token", "num_tokens", "key", "value", "xxh3", "num_layers")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    XXH3_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    start_token: int
    num_tokens: int
    key: bytes
    value: bytes
    xxh3: int
    num_layers: int
    def __init__(self, layer: _Optional[int] = ..., start_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., xxh3: _Optional[int] = ..., num_layers: _Optional[int] = ...) -> None: ...

class FetchKVResponse(_message.Message):
    __slots__ = ("header", "chunk", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    chunk: KVChunk
    trailer: KVTrailer
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., trailer: _Optional[_Union[KVTrailer, _Mapping]] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("transfer_id", "layer_checksums")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    layer_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_id: _Optional[str] = ..., layer_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released", "mismatched_layer")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    MISMATCHED_LAYER_FIELD_NUMBER: _ClassVar[int]
    released: bool
    mismatched_layer: int
    def __init__(self, released: _Optional[bool] = ..., mismatched_layer: _Optional[int] = ...) -> None: ...
