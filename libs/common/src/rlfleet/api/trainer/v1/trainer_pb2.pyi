from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TrainerStatus(_message.Message):
    __slots__ = ("run_id", "policy_version", "step", "paused", "queue_depth", "pending_groups", "trained_trajectories", "dropped_by_reason", "last_metrics", "idle_fraction", "loss", "last_checkpoint", "state", "state_message", "pending_samples")
    class DroppedByReasonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    PENDING_GROUPS_FIELD_NUMBER: _ClassVar[int]
    TRAINED_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_BY_REASON_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    IDLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STATE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PENDING_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    policy_version: int
    step: int
    paused: bool
    queue_depth: int
    pending_groups: int
    trained_trajectories: int
    dropped_by_reason: _containers.ScalarMap[str, int]
    last_metrics: _containers.ScalarMap[str, float]
    idle_fraction: float
    loss: str
    last_checkpoint: str
    state: str
    state_message: str
    pending_samples: int
    def __init__(self, run_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., step: _Optional[int] = ..., paused: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., pending_groups: _Optional[int] = ..., trained_trajectories: _Optional[int] = ..., dropped_by_reason: _Optional[_Mapping[str, int]] = ..., last_metrics: _Optional[_Mapping[str, float]] = ..., idle_fraction: _Optional[float] = ..., loss: _Optional[str] = ..., last_checkpoint: _Optional[str] = ..., state: _Optional[str] = ..., state_message: _Optional[str] = ..., pending_samples: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "policy_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    policy_version: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
