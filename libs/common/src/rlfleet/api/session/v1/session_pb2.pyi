from rlfleet.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_OPEN: _ClassVar[SessionState]
    SESSION_STATE_CLOSED: _ClassVar[SessionState]
    SESSION_STATE_ABORTED: _ClassVar[SessionState]
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_OPEN: SessionState
SESSION_STATE_CLOSED: SessionState
SESSION_STATE_ABORTED: SessionState

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecialToken(_message.Message):
    __slots__ = ("content", "id")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    content: str
    id: int
    def __init__(self, content: _Optional[str] = ..., id: _Optional[int] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("tokenizer_json", "tokenizer_config_json", "chat_template", "bos_token", "eos_token", "pad_token", "special_tokens", "stop_token_ids", "vocab_size", "context_length", "model_type")
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: str
    tokenizer_config_json: str
    chat_template: str
    bos_token: str
    eos_token: str
    pad_token: str
    special_tokens: _containers.RepeatedCompositeFieldContainer[SpecialToken]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    vocab_size: int
    context_length: int
    model_type: str
    def __init__(self, tokenizer_json: _Optional[str] = ..., tokenizer_config_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., bos_token: _Optional[str] = ..., eos_token: _Optional[str] = ..., pad_token: _Optional[str] = ..., special_tokens: _Optional[_Iterable[_Union[SpecialToken, _Mapping]]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., model_type: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "run_id", "task_id", "group_id", "sample_index", "group_size", "prompt_token_ids", "messages", "sampling", "max_total_tokens", "metadata", "suite", "split", "first_turn")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SUITE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TURN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    run_id: str
    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    prompt_token_ids: _common_pb2.TokenIds
    messages: _common_pb2.ChatMessages
    sampling: _common_pb2.SamplingParams
    max_total_tokens: int
    metadata: _containers.ScalarMap[str, str]
    suite: str
    split: str
    first_turn: bool
    def __init__(self, session_id: _Optional[str] = ..., run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., group_size: _Optional[int] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., messages: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_total_tokens: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., suite: _Optional[str] = ..., split: _Optional[str] = ..., first_turn: _Optional[bool] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "prompt_token_ids", "max_total_tokens", "first_turn")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TURN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_total_tokens: int
    first_turn: GenerateResponse
    def __init__(self, session_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_total_tokens: _Optional[int] = ..., first_turn: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "sampling", "observation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    sampling: _common_pb2.SamplingParams
    observation: AppendObservationRequest
    def __init__(self, session_id: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., observation: _Optional[_Union[AppendObservationRequest, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "policy_version", "text", "engine_id", "span_index", "total_tokens", "budget_exhausted", "observation_token_ids", "text_with_special_tokens", "matched_stop_token_id")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SPAN_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_WITH_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    policy_version: int
    text: str
    engine_id: str
    span_index: int
    total_tokens: int
    budget_exhausted: bool
    observation_token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_with_special_tokens: str
    matched_stop_token_id: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., policy_version: _Optional[int] = ..., text: _Optional[str] = ..., engine_id: _Optional[str] = ..., span_index: _Optional[int] = ..., total_tokens: _Optional[int] = ..., budget_exhausted: _Optional[bool] = ..., observation_token_ids: _Optional[_Iterable[int]] = ..., text_with_special_tokens: _Optional[str] = ..., matched_stop_token_id: _Optional[int] = ...) -> None: ...

class AppendObservationRequest(_message.Message):
    __slots__ = ("session_id", "text", "token_ids", "messages", "add_generation_prompt")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    text: str
    token_ids: _common_pb2.TokenIds
    messages: _common_pb2.ChatMessages
    add_generation_prompt: bool
    def __init__(self, session_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.TokenIds, _Mapping]] = ..., messages: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., add_generation_prompt: _Optional[bool] = ...) -> None: ...

class AppendObservationResponse(_message.Message):
    __slots__ = ("token_ids", "span_index", "total_tokens", "tool_wait_s", "budget_exhausted")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPAN_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BUDGET_EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    span_index: int
    total_tokens: int
    tool_wait_s: float
    budget_exhausted: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., span_index: _Optional[int] = ..., total_tokens: _Optional[int] = ..., tool_wait_s: _Optional[float] = ..., budget_exhausted: _Optional[bool] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "state", "run_id", "task_id", "group_id", "sample_index", "token_ids", "rollout_logprobs", "loss_mask", "spans", "max_total_tokens", "engine_id", "trajectory_id", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    state: SessionState
    run_id: str
    task_id: str
    group_id: str
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    spans: _containers.RepeatedCompositeFieldContainer[_common_pb2.Span]
    max_total_tokens: int
    engine_id: str
    trajectory_id: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, session_id: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ..., run_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., spans: _Optional[_Iterable[_Union[_common_pb2.Span, _Mapping]]] = ..., max_total_tokens: _Optional[int] = ..., engine_id: _Optional[str] = ..., trajectory_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "status", "metadata", "return_trajectory")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    RETURN_TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    status: _common_pb2.TrajectoryStatus
    metadata: _containers.ScalarMap[str, str]
    return_trajectory: bool
    def __init__(self, session_id: _Optional[str] = ..., status: _Optional[_Union[_common_pb2.TrajectoryStatus, str]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., return_trajectory: _Optional[bool] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("trajectory_id", "verdict", "published_now", "trajectory", "verdict_missing")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_NOW_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    VERDICT_MISSING_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    verdict: _common_pb2.Verdict
    published_now: bool
    trajectory: _common_pb2.Trajectory
    verdict_missing: bool
    def __init__(self, trajectory_id: _Optional[str] = ..., verdict: _Optional[_Union[_common_pb2.Verdict, _Mapping]] = ..., published_now: _Optional[bool] = ..., trajectory: _Optional[_Union[_common_pb2.Trajectory, _Mapping]] = ..., verdict_missing: _Optional[bool] = ...) -> None: ...

class AbortSessionRequest(_message.Message):
    __slots__ = ("session_id", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reason: str
    def __init__(self, session_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortSessionResponse(_message.Message):
    __slots__ = ("trajectory_id",)
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    def __init__(self, trajectory_id: _Optional[str] = ...) -> None: ...
