from rlfleet.api.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "suite", "task_id", "sandbox_id", "final_answer", "files")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SUITE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_ANSWER_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    suite: str
    task_id: str
    sandbox_id: str
    final_answer: str
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, session_id: _Optional[str] = ..., suite: _Optional[str] = ..., task_id: _Optional[str] = ..., sandbox_id: _Optional[str] = ..., final_answer: _Optional[str] = ..., files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class GetVerdictRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class LabelledEpisode(_message.Message):
    __slots__ = ("suite", "task_id", "final_answer", "files", "transcript", "human_passed", "episode_id")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SUITE_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_ANSWER_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    HUMAN_PASSED_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    suite: str
    task_id: str
    final_answer: str
    files: _containers.ScalarMap[str, bytes]
    transcript: str
    human_passed: bool
    episode_id: str
    def __init__(self, suite: _Optional[str] = ..., task_id: _Optional[str] = ..., final_answer: _Optional[str] = ..., files: _Optional[_Mapping[str, bytes]] = ..., transcript: _Optional[str] = ..., human_passed: _Optional[bool] = ..., episode_id: _Optional[str] = ...) -> None: ...

class AuditRequest(_message.Message):
    __slots__ = ("episodes",)
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    episodes: _containers.RepeatedCompositeFieldContainer[LabelledEpisode]
    def __init__(self, episodes: _Optional[_Iterable[_Union[LabelledEpisode, _Mapping]]] = ...) -> None: ...

class Disagreement(_message.Message):
    __slots__ = ("episode_id", "task_id", "human_passed", "verifier_passed", "reasons")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    HUMAN_PASSED_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_PASSED_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    task_id: str
    human_passed: bool
    verifier_passed: bool
    reasons: _containers.RepeatedCompositeFieldContainer[_common_pb2.FailureReason]
    def __init__(self, episode_id: _Optional[str] = ..., task_id: _Optional[str] = ..., human_passed: _Optional[bool] = ..., verifier_passed: _Optional[bool] = ..., reasons: _Optional[_Iterable[_Union[_common_pb2.FailureReason, _Mapping]]] = ...) -> None: ...

class AuditReport(_message.Message):
    __slots__ = ("n", "true_positives", "false_positives", "true_negatives", "false_negatives", "false_positive_rate", "false_negative_rate", "disagreements", "suites")
    N_FIELD_NUMBER: _ClassVar[int]
    TRUE_POSITIVES_FIELD_NUMBER: _ClassVar[int]
    FALSE_POSITIVES_FIELD_NUMBER: _ClassVar[int]
    TRUE_NEGATIVES_FIELD_NUMBER: _ClassVar[int]
    FALSE_NEGATIVES_FIELD_NUMBER: _ClassVar[int]
    FALSE_POSITIVE_RATE_FIELD_NUMBER: _ClassVar[int]
    FALSE_NEGATIVE_RATE_FIELD_NUMBER: _ClassVar[int]
    DISAGREEMENTS_FIELD_NUMBER: _ClassVar[int]
    SUITES_FIELD_NUMBER: _ClassVar[int]
    n: int
    true_positives: int
    false_positives: int
    true_negatives: int
    false_negatives: int
    false_positive_rate: float
    false_negative_rate: float
    disagreements: _containers.RepeatedCompositeFieldContainer[Disagreement]
    suites: _containers.RepeatedCompositeFieldContainer[SuiteAudit]
    def __init__(self, n: _Optional[int] = ..., true_positives: _Optional[int] = ..., false_positives: _Optional[int] = ..., true_negatives: _Optional[int] = ..., false_negatives: _Optional[int] = ..., false_positive_rate: _Optional[float] = ..., false_negative_rate: _Optional[float] = ..., disagreements: _Optional[_Iterable[_Union[Disagreement, _Mapping]]] = ..., suites: _Optional[_Iterable[_Union[SuiteAudit, _Mapping]]] = ...) -> None: ...

class SuiteAudit(_message.Message):
    __slots__ = ("suite", "n", "true_positives", "false_positives", "true_negatives", "false_negatives", "false_positive_rate", "false_negative_rate")
    SUITE_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    TRUE_POSITIVES_FIELD_NUMBER: _ClassVar[int]
    FALSE_POSITIVES_FIELD_NUMBER: _ClassVar[int]
    TRUE_NEGATIVES_FIELD_NUMBER: _ClassVar[int]
    FALSE_NEGATIVES_FIELD_NUMBER: _ClassVar[int]
    FALSE_POSITIVE_RATE_FIELD_NUMBER: _ClassVar[int]
    FALSE_NEGATIVE_RATE_FIELD_NUMBER: _ClassVar[int]
    suite: str
    n: int
    true_positives: int
    false_positives: int
    true_negatives: int
    false_negatives: int
    false_positive_rate: float
    false_negative_rate: float
    def __init__(self, suite: _Optional[str] = ..., n: _Optional[int] = ..., true_positives: _Optional[int] = ..., false_positives: _Optional[int] = ..., true_negatives: _Optional[int] = ..., false_negatives: _Optional[int] = ..., false_positive_rate: _Optional[float] = ..., false_negative_rate: _Optional[float] = ...) -> None: ...
