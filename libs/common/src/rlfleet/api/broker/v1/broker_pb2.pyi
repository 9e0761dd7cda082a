from rlfleet.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_DISK_FULL: _ClassVar[Transport]
    TRANSPORT_DISK_DELTA: _ClassVar[Transport]
    TRANSPORT_DISTRIBUTED: _ClassVar[Transport]

class VersionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERSION_STATE_UNSPECIFIED: _ClassVar[VersionState]
    VERSION_STATE_ANNOUNCED: _ClassVar[VersionState]
    VERSION_STATE_SKIPPED: _ClassVar[VersionState]
    VERSION_STATE_CANARY: _ClassVar[VersionState]
    VERSION_STATE_ACCEPTED: _ClassVar[VersionState]
    VERSION_STATE_REJECTED: _ClassVar[VersionState]
    VERSION_STATE_ROLLED_BACK: _ClassVar[VersionState]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_DISK_FULL: Transport
TRANSPORT_DISK_DELTA: Transport
TRANSPORT_DISTRIBUTED: Transport
VERSION_STATE_UNSPECIFIED: VersionState
VERSION_STATE_ANNOUNCED: VersionState
VERSION_STATE_SKIPPED: VersionState
VERSION_STATE_CANARY: VersionState
VERSION_STATE_ACCEPTED: VersionState
VERSION_STATE_REJECTED: VersionState
VERSION_STATE_ROLLED_BACK: VersionState

class VersionRecord(_message.Message):
    __slots__ = ("version", "state", "reason", "announced_unix_ms", "canary_unix_ms", "accepted_unix_ms")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CANARY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    version: _common_pb2.PolicyVersion
    state: VersionState
    reason: str
    announced_unix_ms: int
    canary_unix_ms: int
    accepted_unix_ms: int
    def __init__(self, version: _Optional[_Union[_common_pb2.PolicyVersion, _Mapping]] = ..., state: _Optional[_Union[VersionState, str]] = ..., reason: _Optional[str] = ..., announced_unix_ms: _Optional[int] = ..., canary_unix_ms: _Optional[int] = ..., accepted_unix_ms: _Optional[int] = ...) -> None: ...

class PublishVersionResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: VersionState
    def __init__(self, state: _Optional[_Union[VersionState, str]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineVersion(_message.Message):
    __slots__ = ("engine_id", "pool", "policy_version", "state", "last_pause_s", "last_bytes", "last_transport", "last_error")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    pool: str
    policy_version: int
    state: str
    last_pause_s: float
    last_bytes: int
    last_transport: Transport
    last_error: str
    def __init__(self, engine_id: _Optional[str] = ..., pool: _Optional[str] = ..., policy_version: _Optional[int] = ..., state: _Optional[str] = ..., last_pause_s: _Optional[float] = ..., last_bytes: _Optional[int] = ..., last_transport: _Optional[_Union[Transport, str]] = ..., last_error: _Optional[str] = ...) -> None: ...

class BrokerStatus(_message.Message):
    __slots__ = ("run_id", "latest_version", "canary_version", "accepted_version", "engines", "transport")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    latest_version: int
    canary_version: int
    accepted_version: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineVersion]
    transport: Transport
    def __init__(self, run_id: _Optional[str] = ..., latest_version: _Optional[int] = ..., canary_version: _Optional[int] = ..., accepted_version: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineVersion, _Mapping]]] = ..., transport: _Optional[_Union[Transport, str]] = ...) -> None: ...

class ListVersionsRequest(_message.Message):
    __slots__ = ("limit",)
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    def __init__(self, limit: _Optional[int] = ...) -> None: ...

class ListVersionsResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[VersionRecord]
    def __init__(self, versions: _Optional[_Iterable[_Union[VersionRecord, _Mapping]]] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("version", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    reason: str
    def __init__(self, version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class PromoteResponse(_message.Message):
    __slots__ = ("accepted_version",)
    ACCEPTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted_version: int
    def __init__(self, accepted_version: _Optional[int] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("to_version", "reason")
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    to_version: int
    reason: str
    def __init__(self, to_version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class RollbackResponse(_message.Message):
    __slots__ = ("accepted_version",)
    ACCEPTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    accepted_version: int
    def __init__(self, accepted_version: _Optional[int] = ...) -> None: ...
