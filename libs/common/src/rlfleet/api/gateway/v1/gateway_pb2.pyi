from rlfleet.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EnginePool(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_POOL_UNSPECIFIED: _ClassVar[EnginePool]
    ENGINE_POOL_FLEET: _ClassVar[EnginePool]
    ENGINE_POOL_CANARY: _ClassVar[EnginePool]
    ENGINE_POOL_CANDIDATE: _ClassVar[EnginePool]

class EngineKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_KIND_UNSPECIFIED: _ClassVar[EngineKind]
    ENGINE_KIND_CPU: _ClassVar[EngineKind]
    ENGINE_KIND_SGLANG: _ClassVar[EngineKind]

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_HEALTHY: _ClassVar[EngineState]
    ENGINE_STATE_UNHEALTHY: _ClassVar[EngineState]
    ENGINE_STATE_PAUSED: _ClassVar[EngineState]
    ENGINE_STATE_DRAINING: _ClassVar[EngineState]

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_ABORT: _ClassVar[PauseMode]
    PAUSE_MODE_RETRACT: _ClassVar[PauseMode]
    PAUSE_MODE_IN_PLACE: _ClassVar[PauseMode]
ENGINE_POOL_UNSPECIFIED: EnginePool
ENGINE_POOL_FLEET: EnginePool
ENGINE_POOL_CANARY: EnginePool
ENGINE_POOL_CANDIDATE: EnginePool
ENGINE_KIND_UNSPECIFIED: EngineKind
ENGINE_KIND_CPU: EngineKind
ENGINE_KIND_SGLANG: EngineKind
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_HEALTHY: EngineState
ENGINE_STATE_UNHEALTHY: EngineState
ENGINE_STATE_PAUSED: EngineState
ENGINE_STATE_DRAINING: EngineState
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_ABORT: PauseMode
PAUSE_MODE_RETRACT: PauseMode
PAUSE_MODE_IN_PLACE: PauseMode

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "input_ids", "sampling", "return_logprob", "request_id", "engine_pool")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_POOL_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    return_logprob: bool
    request_id: str
    engine_pool: EnginePool
    def __init__(self, session_id: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_logprob: _Optional[bool] = ..., request_id: _Optional[str] = ..., engine_pool: _Optional[_Union[EnginePool, str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("output_ids", "output_logprobs", "finish_reason", "policy_version", "engine_id", "prompt_tokens", "cached_tokens", "latency_s", "text", "rerouted", "reroute_reason", "version_ranges")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REROUTED_FIELD_NUMBER: _ClassVar[int]
    REROUTE_REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_RANGES_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    policy_version: int
    engine_id: str
    prompt_tokens: int
    cached_tokens: int
    latency_s: float
    text: str
    rerouted: bool
    reroute_reason: str
    version_ranges: _containers.RepeatedCompositeFieldContainer[_common_pb2.VersionRange]
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ..., engine_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., latency_s: _Optional[float] = ..., text: _Optional[str] = ..., rerouted: _Optional[bool] = ..., reroute_reason: _Optional[str] = ..., version_ranges: _Optional[_Iterable[_Union[_common_pb2.VersionRange, _Mapping]]] = ...) -> None: ...

class Engine(_message.Message):
    __slots__ = ("engine_id", "url", "pool", "kind", "state", "policy_version", "in_flight_requests", "sessions", "last_error", "last_health_unix_ms", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LAST_HEALTH_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    url: str
    pool: EnginePool
    kind: EngineKind
    state: EngineState
    policy_version: int
    in_flight_requests: int
    sessions: int
    last_error: str
    last_health_unix_ms: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, engine_id: _Optional[str] = ..., url: _Optional[str] = ..., pool: _Optional[_Union[EnginePool, str]] = ..., kind: _Optional[_Union[EngineKind, str]] = ..., state: _Optional[_Union[EngineState, str]] = ..., policy_version: _Optional[int] = ..., in_flight_requests: _Optional[int] = ..., sessions: _Optional[int] = ..., last_error: _Optional[str] = ..., last_health_unix_ms: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("engine_id", "url", "pool", "kind", "labels", "start_draining")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    START_DRAINING_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    url: str
    pool: EnginePool
    kind: EngineKind
    labels: _containers.ScalarMap[str, str]
    start_draining: bool
    def __init__(self, engine_id: _Optional[str] = ..., url: _Optional[str] = ..., pool: _Optional[_Union[EnginePool, str]] = ..., kind: _Optional[_Union[EngineKind, str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., start_draining: _Optional[bool] = ...) -> None: ...

class DeregisterEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class DeregisterEngineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[Engine]
    def __init__(self, engines: _Optional[_Iterable[_Union[Engine, _Mapping]]] = ...) -> None: ...

class PauseEnginesRequest(_message.Message):
    __slots__ = ("engine_ids", "mode")
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    mode: PauseMode
    def __init__(self, engine_ids: _Optional[_Iterable[str]] = ..., mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

class EngineResult(_message.Message):
    __slots__ = ("engine_id", "ok", "message")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    ok: bool
    message: str
    def __init__(self, engine_id: _Optional[str] = ..., ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class PauseEnginesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class ResumeEnginesRequest(_message.Message):
    __slots__ = ("engine_ids",)
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResumeEnginesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[EngineResult]
    def __init__(self, results: _Optional[_Iterable[_Union[EngineResult, _Mapping]]] = ...) -> None: ...

class UpdateEngineStateRequest(_message.Message):
    __slots__ = ("engine_id", "state", "reason", "policy_version")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    state: EngineState
    reason: str
    policy_version: int
    def __init__(self, engine_id: _Optional[str] = ..., state: _Optional[_Union[EngineState, str]] = ..., reason: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("session_id", "run_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    run_id: str
    def __init__(self, session_id: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("admitted", "reason", "retry_after_ms")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    admitted: bool
    reason: str
    retry_after_ms: int
    def __init__(self, admitted: _Optional[bool] = ..., reason: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdmissionPolicy(_message.Message):
    __slots__ = ("max_inflight_sessions", "trainer_version", "max_staleness")
    MAX_INFLIGHT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    max_inflight_sessions: int
    trainer_version: int
    max_staleness: int
    def __init__(self, max_inflight_sessions: _Optional[int] = ..., trainer_version: _Optional[int] = ..., max_staleness: _Optional[int] = ...) -> None: ...

class GetAdmissionStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AdmissionStatus(_message.Message):
    __slots__ = ("policy", "inflight_sessions", "admitted_total", "refused_total", "refused_by_reason", "fleet_min_version")
    class RefusedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POLICY_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REFUSED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    FLEET_MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy: AdmissionPolicy
    inflight_sessions: int
    admitted_total: int
    refused_total: int
    refused_by_reason: _containers.ScalarMap[str, int]
    fleet_min_version: int
    def __init__(self, policy: _Optional[_Union[AdmissionPolicy, _Mapping]] = ..., inflight_sessions: _Optional[int] = ..., admitted_total: _Optional[int] = ..., refused_total: _Optional[int] = ..., refused_by_reason: _Optional[_Mapping[str, int]] = ..., fleet_min_version: _Optional[int] = ...) -> None: ...
