from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_GPU_HOT: _ClassVar[Tier]
    TIER_STORAGE_WARM: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_GPU_HOT: Tier
TIER_STORAGE_WARM: Tier

class SubscribeRequest(_message.Message):
    __slots__ = ("backend", "resume_from_id")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_ID_FIELD_NUMBER: _ClassVar[int]
    backend: str
    resume_from_id: int
    def __init__(self, backend: _Optional[str] = ..., resume_from_id: _Optional[int] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("backend", "model", "engine", "key_block_size", "last_id", "resumed")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KEY_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    backend: str
    model: str
    engine: str
    key_block_size: int
    last_id: int
    resumed: bool
    def __init__(self, backend: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., key_block_size: _Optional[int] = ..., last_id: _Optional[int] = ..., resumed: _Optional[bool] = ...) -> None: ...

class Put(_message.Message):
    __slots__ = ("keys", "tier", "page_tokens")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    tier: Tier
    page_tokens: int
    def __init__(self, keys: _Optional[_Iterable[int]] = ..., tier: _Optional[_Union[Tier, str]] = ..., page_tokens: _Optional[int] = ...) -> None: ...

class Del(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, keys: _Optional[_Iterable[int]] = ...) -> None: ...

class Clear(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SnapshotBegin(_message.Message):
    __slots__ = ("last_id", "entries")
    LAST_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    last_id: int
    entries: int
    def __init__(self, last_id: _Optional[int] = ..., entries: _Optional[int] = ...) -> None: ...

class SnapshotEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Close(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Keepalive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FeedRecord(_message.Message):
    __slots__ = ("id", "hello", "put", "clear", "snapshot_begin", "snapshot_end", "close", "keepalive")
    ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PUT_FIELD_NUMBER: _ClassVar[int]
    DEL_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_BEGIN_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_END_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    id: int
    hello: Hello
    put: Put
    clear: Clear
    snapshot_begin: SnapshotBegin
    snapshot_end: SnapshotEnd
    close: Close
    keepalive: Keepalive
    def __init__(self, id: _Optional[int] = ..., hello: _Optional[_Union[Hello, _Mapping]] = ..., put: _Optional[_Union[Put, _Mapping]] = ..., clear: _Optional[_Union[Clear, _Mapping]] = ..., snapshot_begin: _Optional[_Union[SnapshotBegin, _Mapping]] = ..., snapshot_end: _Optional[_Union[SnapshotEnd, _Mapping]] = ..., close: _Optional[_Union[Close, _Mapping]] = ..., keepalive: _Optional[_Union[Keepalive, _Mapping]] = ..., **kwargs) -> None: ...

class ListBackendsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackendInfo(_message.Message):
    __slots__ = ("backend", "model", "engine", "key_block_size", "last_id", "entries", "subscribers")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    KEY_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAST_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBERS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    model: str
    engine: str
    key_block_size: int
    last_id: int
    entries: int
    subscribers: int
    def __init__(self, backend: _Optional[str] = ..., model: _Optional[str] = ..., engine: _Optional[str] = ..., key_block_size: _Optional[int] = ..., last_id: _Optional[int] = ..., entries: _Optional[int] = ..., subscribers: _Optional[int] = ...) -> None: ...

class ListBackendsResponse(_message.Message):
    __slots__ = ("backends",)
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    backends: _containers.RepeatedCompositeFieldContainer[BackendInfo]
    def __init__(self, backends: _Optional[_Iterable[_Union[BackendInfo, _Mapping]]] = ...) -> None: ...
