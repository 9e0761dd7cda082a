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
    TRANSPORT_P2P: _ClassVar[Transport]
    TRANSPORT_TENSOR: _ClassVar[Transport]

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
TRANSPORT_P2P: Transport
TRANSPORT_TENSOR: Transport
VERSION_STATE_UNSPECIFIED: VersionState
VERSION_STATE_ANNOUNCED: VersionState
VERSION_STATE_SKIPPED: VersionState
VERSION_STATE_CANARY: VersionState
VERSION_STATE_ACCEPTED: VersionState
VERSION_STATE_REJECTED: VersionState
VERSION_STATE_ROLLED_BACK: VersionState

class VersionRecord(_message.Message):
    __slots__ = ("version", "state", "reason", "announced_unix_ms", "canary_unix_ms", "accepted_unix_ms", "fleet_serving_unix_ms", "rejected_unix_ms")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ANNOUNCED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CANARY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FLEET_SERVING_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    version: _common_pb2.PolicyVersion
    state: VersionState
    reason: str
    announced_unix_ms: int
    canary_unix_ms: int
    accepted_unix_ms: int
    fleet_serving_unix_ms: int
    rejected_unix_ms: int
    def __init__(self, version: _Optional[_Union[_common_pb2.PolicyVersion, _Mapping]] = ..., state: _Optional[_Union[VersionState, str]] = ..., reason: _Optional[str] = ..., announced_unix_ms: _Optional[int] = ..., canary_unix_ms: _Optional[int] = ..., accepted_unix_ms: _Optional[int] = ..., fleet_serving_unix_ms: _Optional[int] = ..., rejected_unix_ms: _Optional[int] = ...) -> None: ...

class PublishVersionResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: VersionState
    def __init__(self, state: _Optional[_Union[VersionState, str]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineVersion(_message.Message):
    __slots__ = ("engine_id", "pool", "policy_version", "state", "last_pause_s", "last_bytes", "last_transport", "last_error", "url", "target_version", "updates", "fallbacks", "transport")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    LAST_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    TARGET_VERSION_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    pool: str
    policy_version: int
    state: str
    last_pause_s: float
    last_bytes: int
    last_transport: Transport
    last_error: str
    url: str
    target_version: int
    updates: int
    fallbacks: int
    transport: Transport
    def __init__(self, engine_id: _Optional[str] = ..., pool: _Optional[str] = ..., policy_version: _Optional[int] = ..., state: _Optional[str] = ..., last_pause_s: _Optional[float] = ..., last_bytes: _Optional[int] = ..., last_transport: _Optional[_Union[Transport, str]] = ..., last_error: _Optional[str] = ..., url: _Optional[str] = ..., target_version: _Optional[int] = ..., updates: _Optional[int] = ..., fallbacks: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ...) -> None: ...

class BrokerStatus(_message.Message):
    __slots__ = ("run_id", "latest_version", "canary_version", "accepted_version", "engines", "transport", "auto_promote", "fleet_version", "candidate_version")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    LATEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    AUTO_PROMOTE_FIELD_NUMBER: _ClassVar[int]
    FLEET_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    latest_version: int
    canary_version: int
    accepted_version: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineVersion]
    transport: Transport
    auto_promote: bool
    fleet_version: int
    candidate_version: int
    def __init__(self, run_id: _Optional[str] = ..., latest_version: _Optional[int] = ..., canary_version: _Optional[int] = ..., accepted_version: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineVersion, _Mapping]]] = ..., transport: _Optional[_Union[Transport, str]] = ..., auto_promote: _Optional[bool] = ..., fleet_version: _Optional[int] = ..., candidate_version: _Optional[int] = ...) -> None: ...

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

class PinCandidateRequest(_message.Message):
    __slots__ = ("version", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    reason: str
    def __init__(self, version: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class PinCandidateResponse(_message.Message):
    __slots__ = ("candidate_version",)
    CANDIDATE_VERSION_FIELD_NUMBER: _ClassVar[int]
    candidate_version: int
    def __init__(self, candidate_version: _Optional[int] = ...) -> None: ...

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

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "checksum")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    checksum: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., checksum: _Optional[str] = ...) -> None: ...

class StartDistributedSyncRequest(_message.Message):
    __slots__ = ("version", "master_address", "master_port", "backend", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: _common_pb2.PolicyVersion
    master_address: str
    master_port: int
    backend: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, version: _Optional[_Union[_common_pb2.PolicyVersion, _Mapping]] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., backend: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class StartDistributedSyncResponse(_message.Message):
    __slots__ = ("group_name", "world_size", "engine_ids", "state", "rank_offsets", "tp_sizes")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZES_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    world_size: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    state: VersionState
    rank_offsets: _containers.RepeatedScalarFieldContainer[int]
    tp_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_name: _Optional[str] = ..., world_size: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ..., state: _Optional[_Union[VersionState, str]] = ..., rank_offsets: _Optional[_Iterable[int]] = ..., tp_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class StartTrainerSyncRequest(_message.Message):
    __slots__ = ("version", "tensors", "checksum_algorithm", "master_address", "master_port", "backend", "store_pending")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STORE_PENDING_FIELD_NUMBER: _ClassVar[int]
    version: _common_pb2.PolicyVersion
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    checksum_algorithm: str
    master_address: str
    master_port: int
    backend: str
    store_pending: bool
    def __init__(self, version: _Optional[_Union[_common_pb2.PolicyVersion, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., checksum_algorithm: _Optional[str] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., backend: _Optional[str] = ..., store_pending: _Optional[bool] = ...) -> None: ...

class BroadcastGroup(_message.Message):
    __slots__ = ("group_name", "world_size", "engine_ids", "rank_offsets", "tp_sizes")
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZES_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    world_size: int
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    rank_offsets: _containers.RepeatedScalarFieldContainer[int]
    tp_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, group_name: _Optional[str] = ..., world_size: _Optional[int] = ..., engine_ids: _Optional[_Iterable[str]] = ..., rank_offsets: _Optional[_Iterable[int]] = ..., tp_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerTarget(_message.Message):
    __slots__ = ("engine_id", "endpoint_json")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_JSON_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    endpoint_json: str
    def __init__(self, engine_id: _Optional[str] = ..., endpoint_json: _Optional[str] = ...) -> None: ...

class TrainerSyncPlan(_message.Message):
    __slots__ = ("sync_id", "state", "broadcast", "peers", "tensor_engine_ids", "bucket_bytes", "flip_before_stored")
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FLIP_BEFORE_STORED_FIELD_NUMBER: _ClassVar[int]
    sync_id: str
    state: VersionState
    broadcast: BroadcastGroup
    peers: _containers.RepeatedCompositeFieldContainer[PeerTarget]
    tensor_engine_ids: _containers.RepeatedScalarFieldContainer[str]
    bucket_bytes: int
    flip_before_stored: bool
    def __init__(self, sync_id: _Optional[str] = ..., state: _Optional[_Union[VersionState, str]] = ..., broadcast: _Optional[_Union[BroadcastGroup, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[PeerTarget, _Mapping]]] = ..., tensor_engine_ids: _Optional[_Iterable[str]] = ..., bucket_bytes: _Optional[int] = ..., flip_before_stored: _Optional[bool] = ...) -> None: ...

class PeerResult(_message.Message):
    __slots__ = ("engine_id", "sent", "bytes", "error")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    sent: bool
    bytes: int
    error: str
    def __init__(self, engine_id: _Optional[str] = ..., sent: _Optional[bool] = ..., bytes: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class FinishTrainerSyncRequest(_message.Message):
    __slots__ = ("sync_id", "peers", "serialized_named_tensors", "broadcast_sent", "error", "stored", "store_error", "store_follows")
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SERIALIZED_NAMED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_SENT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    STORE_ERROR_FIELD_NUMBER: _ClassVar[int]
    STORE_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    sync_id: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerResult]
    serialized_named_tensors: _containers.RepeatedScalarFieldContainer[str]
    broadcast_sent: bool
    error: str
    stored: _common_pb2.PolicyVersion
    store_error: str
    store_follows: bool
    def __init__(self, sync_id: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerResult, _Mapping]]] = ..., serialized_named_tensors: _Optional[_Iterable[str]] = ..., broadcast_sent: _Optional[bool] = ..., error: _Optional[str] = ..., stored: _Optional[_Union[_common_pb2.PolicyVersion, _Mapping]] = ..., store_error: _Optional[str] = ..., store_follows: _Optional[bool] = ...) -> None: ...

class ConfirmTrainerSyncRequest(_message.Message):
    __slots__ = ("sync_id", "stored", "store_error")
    SYNC_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    STORE_ERROR_FIELD_NUMBER: _ClassVar[int]
    sync_id: str
    stored: _common_pb2.PolicyVersion
    store_error: str
    def __init__(self, sync_id: _Optional[str] = ..., stored: _Optional[_Union[_common_pb2.PolicyVersion, _Mapping]] = ..., store_error: _Optional[str] = ...) -> None: ...

class ConfirmTrainerSyncResponse(_message.Message):
    __slots__ = ("state", "reverted_engine_ids")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REVERTED_ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    state: VersionState
    reverted_engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, state: _Optional[_Union[VersionState, str]] = ..., reverted_engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineSyncOutcome(_message.Message):
    __slots__ = ("engine_id", "transport", "ok", "pause_s", "bytes", "message", "falls_back")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FALLS_BACK_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    transport: Transport
    ok: bool
    pause_s: float
    bytes: int
    message: str
    falls_back: bool
    def __init__(self, engine_id: _Optional[str] = ..., transport: _Optional[_Union[Transport, str]] = ..., ok: _Optional[bool] = ..., pause_s: _Optional[float] = ..., bytes: _Optional[int] = ..., message: _Optional[str] = ..., falls_back: _Optional[bool] = ...) -> None: ...

class FinishTrainerSyncResponse(_message.Message):
    __slots__ = ("outcomes", "awaits_confirm")
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    AWAITS_CONFIRM_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[EngineSyncOutcome]
    awaits_confirm: bool
    def __init__(self, outcomes: _Optional[_Iterable[_Union[EngineSyncOutcome, _Mapping]]] = ..., awaits_confirm: _Optional[bool] = ...) -> None: ...
