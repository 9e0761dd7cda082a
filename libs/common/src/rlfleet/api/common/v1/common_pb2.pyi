from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SchemaVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEMA_VERSION_UNSPECIFIED: _ClassVar[SchemaVersion]
    SCHEMA_VERSION_1: _ClassVar[SchemaVersion]

class SpanKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPAN_KIND_UNSPECIFIED: _ClassVar[SpanKind]
    SPAN_KIND_PROMPT: _ClassVar[SpanKind]
    SPAN_KIND_GENERATED: _ClassVar[SpanKind]
    SPAN_KIND_OBSERVATION: _ClassVar[SpanKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class ReasonCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_CODE_UNSPECIFIED: _ClassVar[ReasonCode]
    REASON_CODE_WRONG_ANSWER: _ClassVar[ReasonCode]
    REASON_CODE_NO_ANSWER: _ClassVar[ReasonCode]
    REASON_CODE_TEST_FAILED: _ClassVar[ReasonCode]
    REASON_CODE_TIMEOUT: _ClassVar[ReasonCode]
    REASON_CODE_INVALID_TOOL_CALL: _ClassVar[ReasonCode]
    REASON_CODE_SAFETY_VIOLATION: _ClassVar[ReasonCode]
    REASON_CODE_TRUNCATED: _ClassVar[ReasonCode]
    REASON_CODE_VERIFIER_ERROR: _ClassVar[ReasonCode]
    REASON_CODE_EXCEPTION: _ClassVar[ReasonCode]
    REASON_CODE_REWARD_HACKING: _ClassVar[ReasonCode]
    REASON_CODE_OTHER: _ClassVar[ReasonCode]

class TrajectoryStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAJECTORY_STATUS_UNSPECIFIED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_COMPLETED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_TRUNCATED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_ABORTED: _ClassVar[TrajectoryStatus]
    TRAJECTORY_STATUS_FAILED: _ClassVar[TrajectoryStatus]

class WeightFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_FORMAT_UNSPECIFIED: _ClassVar[WeightFormat]
    WEIGHT_FORMAT_FULL: _ClassVar[WeightFormat]
    WEIGHT_FORMAT_DELTA: _ClassVar[WeightFormat]
    WEIGHT_FORMAT_ADAPTER: _ClassVar[WeightFormat]
SCHEMA_VERSION_UNSPECIFIED: SchemaVersion
SCHEMA_VERSION_1: SchemaVersion
SPAN_KIND_UNSPECIFIED: SpanKind
SPAN_KIND_PROMPT: SpanKind
SPAN_KIND_GENERATED: SpanKind
SPAN_KIND_OBSERVATION: SpanKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
REASON_CODE_UNSPECIFIED: ReasonCode
REASON_CODE_WRONG_ANSWER: ReasonCode
REASON_CODE_NO_ANSWER: ReasonCode
REASON_CODE_TEST_FAILED: ReasonCode
REASON_CODE_TIMEOUT: ReasonCode
REASON_CODE_INVALID_TOOL_CALL: ReasonCode
REASON_CODE_SAFETY_VIOLATION: ReasonCode
REASON_CODE_TRUNCATED: ReasonCode
REASON_CODE_VERIFIER_ERROR: ReasonCode
REASON_CODE_EXCEPTION: ReasonCode
REASON_CODE_REWARD_HACKING: ReasonCode
REASON_CODE_OTHER: ReasonCode
TRAJECTORY_STATUS_UNSPECIFIED: TrajectoryStatus
TRAJECTORY_STATUS_COMPLETED: TrajectoryStatus
TRAJECTORY_STATUS_TRUNCATED: TrajectoryStatus
TRAJECTORY_STATUS_ABORTED: TrajectoryStatus
TRAJECTORY_STATUS_FAILED: TrajectoryStatus
WEIGHT_FORMAT_UNSPECIFIED: WeightFormat
WEIGHT_FORMAT_FULL: WeightFormat
WEIGHT_FORMAT_DELTA: WeightFormat
WEIGHT_FORMAT_ADAPTER: WeightFormat

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed", "ignore_eos")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    ignore_eos: bool
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class VersionRange(_message.Message):
    __slots__ = ("policy_version", "start", "end")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    start: int
    end: int
    def __init__(self, policy_version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Span(_message.Message):
    __slots__ = ("kind", "start", "end", "policy_version", "finish_reason", "engine_id", "latency_s", "version_ranges")
    KIND_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_RANGES_FIELD_NUMBER: _ClassVar[int]
    kind: SpanKind
    start: int
    end: int
    policy_version: int
    finish_reason: FinishReason
    engine_id: str
    latency_s: float
    version_ranges: _containers.RepeatedCompositeFieldContainer[VersionRange]
    def __init__(self, kind: _Optional[_Union[SpanKind, str]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., policy_version: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., engine_id: _Optional[str] = ..., latency_s: _Optional[float] = ..., version_ranges: _Optional[_Iterable[_Union[VersionRange, _Mapping]]] = ...) -> None: ...

class FailureReason(_message.Message):
    __slots__ = ("code", "message", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: ReasonCode
    message: str
    details: _containers.ScalarMap[str, str]
    def __init__(self, code: _Optional[_Union[ReasonCode, str]] = ..., message: _Optional[str] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("schema_version", "session_id", "task_id", "reward", "passed", "reasons", "verifier_kind", "created_unix_ms", "verify_s")
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_KIND_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    session_id: str
    task_id: str
    reward: float
    passed: bool
    reasons: _containers.RepeatedCompositeFieldContainer[FailureReason]
    verifier_kind: str
    created_unix_ms: int
    verify_s: float
    def __init__(self, schema_version: _Optional[int] = ..., session_id: _Optional[str] = ..., task_id: _Optional[str] = ..., reward: _Optional[float] = ..., passed: _Optional[bool] = ..., reasons: _Optional[_Iterable[_Union[FailureReason, _Mapping]]] = ..., verifier_kind: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., verify_s: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("generate_s", "tool_wait_s", "verify_s", "wall_s", "opened_unix_ms", "closed_unix_ms")
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    WALL_S_FIELD_NUMBER: _ClassVar[int]
    OPENED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    generate_s: float
    tool_wait_s: float
    verify_s: float
    wall_s: float
    opened_unix_ms: int
    closed_unix_ms: int
    def __init__(self, generate_s: _Optional[float] = ..., tool_wait_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., wall_s: _Optional[float] = ..., opened_unix_ms: _Optional[int] = ..., closed_unix_ms: _Optional[int] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("schema_version", "trajectory_id", "run_id", "task_id", "group_id", "sample_index", "group_size", "session_id", "token_ids", "rollout_logprobs", "loss_mask", "spans", "verdict", "status", "timings", "num_turns", "num_observations", "metadata", "suite", "split", "trace_context")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    NUM_OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SUITE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    trajectory_id: str
    run_id: str
    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    verdict: Verdict
    status: TrajectoryStatus
    timings: Timings
    num_turns: int
    num_observations: int
    metadata: _containers.ScalarMap[str, str]
    suite: str
    split: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, schema_version: _Optional[int] = ..., trajectory_id: _Optional[str] = ..., run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., group_size: _Optional[int] = ..., session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., status: _Optional[_Union[TrajectoryStatus, str]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., num_turns: _Optional[int] = ..., num_observations: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., suite: _Optional[str] = ..., split: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class PolicyVersion(_message.Message):
    __slots__ = ("schema_version", "run_id", "version", "parent_version", "format", "base_version", "uri", "full_uri", "checksum", "num_bytes", "step", "created_unix_ms", "metrics", "served_dtype")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PARENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    FULL_URI_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SERVED_DTYPE_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    run_id: str
    version: int
    parent_version: int
    format: WeightFormat
    base_version: int
    uri: str
    full_uri: str
    checksum: str
    num_bytes: int
    step: int
    created_unix_ms: int
    metrics: _containers.ScalarMap[str, float]
    served_dtype: str
    def __init__(self, schema_version: _Optional[int] = ..., run_id: _Optional[str] = ..., version: _Optional[int] = ..., parent_version: _Optional[int] = ..., format: _Optional[_Union[WeightFormat, str]] = ..., base_version: _Optional[int] = ..., uri: _Optional[str] = ..., full_uri: _Optional[str] = ..., checksum: _Optional[str] = ..., num_bytes: _Optional[int] = ..., step: _Optional[int] = ..., created_unix_ms: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., served_dtype: _Optional[str] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("schema_version", "run_id", "task_id", "suite", "split", "messages", "tools", "group_size", "sampling", "max_turns", "episode_timeout_s", "metadata", "group_id")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SUITE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    run_id: str
    task_id: str
    suite: str
    split: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools: _containers.RepeatedScalarFieldContainer[str]
    group_size: int
    sampling: SamplingParams
    max_turns: int
    episode_timeout_s: float
    metadata: _containers.ScalarMap[str, str]
    group_id: str
    def __init__(self, schema_version: _Optional[int] = ..., run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., suite: _Optional[str] = ..., split: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[str]] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_turns: _Optional[int] = ..., episode_timeout_s: _Optional[float] = ..., metadata: _Optional[_Mapping[str, str]] = ..., group_id: _Optional[str] = ...) -> None: ...
