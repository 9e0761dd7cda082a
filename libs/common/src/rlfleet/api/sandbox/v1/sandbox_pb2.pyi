from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ViolationKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VIOLATION_KIND_UNSPECIFIED: _ClassVar[ViolationKind]
    VIOLATION_KIND_TIMEOUT: _ClassVar[ViolationKind]
    VIOLATION_KIND_MEMORY: _ClassVar[ViolationKind]
    VIOLATION_KIND_CPU: _ClassVar[ViolationKind]
    VIOLATION_KIND_PROCESSES: _ClassVar[ViolationKind]
    VIOLATION_KIND_OUTPUT: _ClassVar[ViolationKind]
    VIOLATION_KIND_FILE_SIZE: _ClassVar[ViolationKind]
    VIOLATION_KIND_FILESYSTEM: _ClassVar[ViolationKind]
    VIOLATION_KIND_NETWORK: _ClassVar[ViolationKind]
VIOLATION_KIND_UNSPECIFIED: ViolationKind
VIOLATION_KIND_TIMEOUT: ViolationKind
VIOLATION_KIND_MEMORY: ViolationKind
VIOLATION_KIND_CPU: ViolationKind
VIOLATION_KIND_PROCESSES: ViolationKind
VIOLATION_KIND_OUTPUT: ViolationKind
VIOLATION_KIND_FILE_SIZE: ViolationKind
VIOLATION_KIND_FILESYSTEM: ViolationKind
VIOLATION_KIND_NETWORK: ViolationKind

class Limits(_message.Message):
    __slots__ = ("cpu_seconds", "memory_bytes", "wall_seconds", "max_processes", "max_file_bytes", "max_output_bytes")
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    MAX_FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    cpu_seconds: float
    memory_bytes: int
    wall_seconds: float
    max_processes: int
    max_file_bytes: int
    max_output_bytes: int
    def __init__(self, cpu_seconds: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., wall_seconds: _Optional[float] = ..., max_processes: _Optional[int] = ..., max_file_bytes: _Optional[int] = ..., max_output_bytes: _Optional[int] = ...) -> None: ...

class File(_message.Message):
    __slots__ = ("path", "content", "mode")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    path: str
    content: bytes
    mode: int
    def __init__(self, path: _Optional[str] = ..., content: _Optional[bytes] = ..., mode: _Optional[int] = ...) -> None: ...

class CreateSandboxRequest(_message.Message):
    __slots__ = ("files", "limits", "network", "env", "ttl_seconds", "labels", "session_id")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[File]
    limits: Limits
    network: bool
    env: _containers.ScalarMap[str, str]
    ttl_seconds: float
    labels: _containers.ScalarMap[str, str]
    session_id: str
    def __init__(self, files: _Optional[_Iterable[_Union[File, _Mapping]]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., network: _Optional[bool] = ..., env: _Optional[_Mapping[str, str]] = ..., ttl_seconds: _Optional[float] = ..., labels: _Optional[_Mapping[str, str]] = ..., session_id: _Optional[str] = ...) -> None: ...

class Violation(_message.Message):
    __slots__ = ("kind", "message", "at_unix_ms")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    kind: ViolationKind
    message: str
    at_unix_ms: int
    def __init__(self, kind: _Optional[_Union[ViolationKind, str]] = ..., message: _Optional[str] = ..., at_unix_ms: _Optional[int] = ...) -> None: ...

class Sandbox(_message.Message):
    __slots__ = ("sandbox_id", "created_unix_ms", "expires_unix_ms", "from_warm_pool", "limits", "network", "violations", "exec_count", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FROM_WARM_POOL_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    EXEC_COUNT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    created_unix_ms: int
    expires_unix_ms: int
    from_warm_pool: bool
    limits: Limits
    network: bool
    violations: _containers.RepeatedCompositeFieldContainer[Violation]
    exec_count: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, sandbox_id: _Optional[str] = ..., created_unix_ms: _Optional[int] = ..., expires_unix_ms: _Optional[int] = ..., from_warm_pool: _Optional[bool] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., network: _Optional[bool] = ..., violations: _Optional[_Iterable[_Union[Violation, _Mapping]]] = ..., exec_count: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ExecRequest(_message.Message):
    __slots__ = ("sandbox_id", "argv", "stdin", "timeout_seconds", "env", "cwd")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    ARGV_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CWD_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    argv: _containers.RepeatedScalarFieldContainer[str]
    stdin: bytes
    timeout_seconds: float
    env: _containers.ScalarMap[str, str]
    cwd: str
    def __init__(self, sandbox_id: _Optional[str] = ..., argv: _Optional[_Iterable[str]] = ..., stdin: _Optional[bytes] = ..., timeout_seconds: _Optional[float] = ..., env: _Optional[_Mapping[str, str]] = ..., cwd: _Optional[str] = ...) -> None: ...

class ExecResult(_message.Message):
    __slots__ = ("exit_code", "signal", "stdout", "stderr", "stdout_truncated", "stderr_truncated", "duration_s", "cpu_s", "max_rss_bytes", "violations")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    MAX_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    VIOLATIONS_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    signal: int
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    duration_s: float
    cpu_s: float
    max_rss_bytes: int
    violations: _containers.RepeatedCompositeFieldContainer[Violation]
    def __init__(self, exit_code: _Optional[int] = ..., signal: _Optional[int] = ..., stdout: _Optional[bytes] = ..., stderr: _Optional[bytes] = ..., stdout_truncated: _Optional[bool] = ..., stderr_truncated: _Optional[bool] = ..., duration_s: _Optional[float] = ..., cpu_s: _Optional[float] = ..., max_rss_bytes: _Optional[int] = ..., violations: _Optional[_Iterable[_Union[Violation, _Mapping]]] = ...) -> None: ...

class WriteFilesRequest(_message.Message):
    __slots__ = ("sandbox_id", "files")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    files: _containers.RepeatedCompositeFieldContainer[File]
    def __init__(self, sandbox_id: _Optional[str] = ..., files: _Optional[_Iterable[_Union[File, _Mapping]]] = ...) -> None: ...

class WriteFilesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReadFilesRequest(_message.Message):
    __slots__ = ("sandbox_id", "paths", "max_bytes_per_file")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_PER_FILE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    paths: _containers.RepeatedScalarFieldContainer[str]
    max_bytes_per_file: int
    def __init__(self, sandbox_id: _Optional[str] = ..., paths: _Optional[_Iterable[str]] = ..., max_bytes_per_file: _Optional[int] = ...) -> None: ...

class ReadFilesResponse(_message.Message):
    __slots__ = ("files", "missing")
    FILES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[File]
    missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, files: _Optional[_Iterable[_Union[File, _Mapping]]] = ..., missing: _Optional[_Iterable[str]] = ...) -> None: ...

class ListFilesRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ListFilesResponse(_message.Message):
    __slots__ = ("paths",)
    PATHS_FIELD_NUMBER: _ClassVar[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, paths: _Optional[_Iterable[str]] = ...) -> None: ...

class GetSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class DestroySandboxRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class DestroySandboxResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
