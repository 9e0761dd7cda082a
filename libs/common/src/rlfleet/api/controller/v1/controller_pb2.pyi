from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StartRunRequest(_message.Message):
    __slots__ = ("config_json", "resume", "fresh")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    FRESH_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    resume: bool
    fresh: bool
    def __init__(self, config_json: _Optional[str] = ..., resume: _Optional[bool] = ..., fresh: _Optional[bool] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("from_line",)
    FROM_LINE_FIELD_NUMBER: _ClassVar[int]
    from_line: int
    def __init__(self, from_line: _Optional[int] = ...) -> None: ...

class RunInfo(_message.Message):
    __slots__ = ("run_id", "status", "reason", "loop_s", "accepted_version", "steps", "gate_decisions", "run_dir", "driven_by", "resumes", "lines")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOOP_S_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GATE_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    DRIVEN_BY_FIELD_NUMBER: _ClassVar[int]
    RESUMES_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    status: str
    reason: str
    loop_s: float
    accepted_version: int
    steps: int
    gate_decisions: int
    run_dir: str
    driven_by: str
    resumes: int
    lines: int
    def __init__(self, run_id: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., loop_s: _Optional[float] = ..., accepted_version: _Optional[int] = ..., steps: _Optional[int] = ..., gate_decisions: _Optional[int] = ..., run_dir: _Optional[str] = ..., driven_by: _Optional[str] = ..., resumes: _Optional[int] = ..., lines: _Optional[int] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("line_number", "line", "ended", "run")
    LINE_NUMBER_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    line_number: int
    line: str
    ended: bool
    run: RunInfo
    def __init__(self, line_number: _Optional[int] = ..., line: _Optional[str] = ..., ended: _Optional[bool] = ..., run: _Optional[_Union[RunInfo, _Mapping]] = ...) -> None: ...
