from protos.tandem.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVGroup(_message.Message):
    __slots__ = ("window", "layers")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    window: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, window: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "groups")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    groups: _containers.RepeatedCompositeFieldContainer[KVGroup]
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., groups: _Optional[_Iterable[_Union[KVGroup, _Mapping]]] = ...) -> None: ...

class PrefillInfo(_message.Message):
    __slots__ = ("model_fingerprint", "kv_layout", "compatibility_hash", "version")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    kv_layout: KVLayout
    compatibility_hash: str
    version: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., kv_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., compatibility_hash: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "compatibility_hash", "cache_salt", "num_held_blocks", "held_prefix_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HELD_PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    compatibility_hash: str
    cache_salt: str
    num_held_blocks: int
    held_prefix_hash: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., compatibility_hash: _Optional[str] = ..., cache_salt: _Optional[str] = ..., num_held_blocks: _Optional[int] = ..., held_prefix_hash: _Optional[bytes] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("block_start", "num_blocks", "layer_start", "num_layers", "dtype", "shape", "payload", "crc32c", "group")
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    block_start: int
    num_blocks: int
    layer_start: int
    num_layers: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    crc32c: int
    group: int
    def __init__(self, block_start: _Optional[int] = ..., num_blocks: _Optional[int] = ..., layer_start: _Optional[int] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., group: _Optional[int] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token_id", "first_token_logprob", "top_logprobs", "num_prompt_tokens", "timings", "num_cached_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_token_logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TopLogprob]
    num_prompt_tokens: int
    timings: PrefillTimings
    num_cached_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TopLogprob, _Mapping]]] = ..., num_prompt_tokens: _Optional[int] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("kv", "done")
    KV_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    kv: KVChunk
    done: PrefillDone
    def __init__(self, kv: _Optional[_Union[KVChunk, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...
