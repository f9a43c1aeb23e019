from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Split(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPLIT_UNSPECIFIED: _ClassVar[Split]
    SPLIT_TRAIN: _ClassVar[Split]
    SPLIT_EVAL_ID: _ClassVar[Split]
    SPLIT_EVAL_OOD: _ClassVar[Split]
    SPLIT_EVAL: _ClassVar[Split]
SPLIT_UNSPECIFIED: Split
SPLIT_TRAIN: Split
SPLIT_EVAL_ID: Split
SPLIT_EVAL_OOD: Split
SPLIT_EVAL: Split

class AnswerEquals(_message.Message):
    __slots__ = ("expected", "case_insensitive")
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    CASE_INSENSITIVE_FIELD_NUMBER: _ClassVar[int]
    expected: str
    case_insensitive: bool
    def __init__(self, expected: _Optional[str] = ..., case_insensitive: _Optional[bool] = ...) -> None: ...

class AnswerIntegerEquals(_message.Message):
    __slots__ = ("expected",)
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    expected: int
    def __init__(self, expected: _Optional[int] = ...) -> None: ...

class AnswerMatches(_message.Message):
    __slots__ = ("pattern", "case_insensitive")
    PATTERN_FIELD_NUMBER: _ClassVar[int]
    CASE_INSENSITIVE_FIELD_NUMBER: _ClassVar[int]
    pattern: str
    case_insensitive: bool
    def __init__(self, pattern: _Optional[str] = ..., case_insensitive: _Optional[bool] = ...) -> None: ...

class FileExists(_message.Message):
    __slots__ = ("path", "directory")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    path: str
    directory: bool
    def __init__(self, path: _Optional[str] = ..., directory: _Optional[bool] = ...) -> None: ...

class FileContains(_message.Message):
    __slots__ = ("path", "substring", "regex")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SUBSTRING_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    path: str
    substring: str
    regex: str
    def __init__(self, path: _Optional[str] = ..., substring: _Optional[str] = ..., regex: _Optional[str] = ...) -> None: ...

class FileSha256(_message.Message):
    __slots__ = ("path", "sha256")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    path: str
    sha256: str
    def __init__(self, path: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class CommandOutputEquals(_message.Message):
    __slots__ = ("command", "expected", "reference_command")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_COMMAND_FIELD_NUMBER: _ClassVar[int]
    command: str
    expected: str
    reference_command: str
    def __init__(self, command: _Optional[str] = ..., expected: _Optional[str] = ..., reference_command: _Optional[str] = ...) -> None: ...

class CommandExitCode(_message.Message):
    __slots__ = ("command", "exit_code")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    command: str
    exit_code: int
    def __init__(self, command: _Optional[str] = ..., exit_code: _Optional[int] = ...) -> None: ...

class PluginCheck(_message.Message):
    __slots__ = ("type", "params_json")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    type: str
    params_json: str
    def __init__(self, type: _Optional[str] = ..., params_json: _Optional[str] = ...) -> None: ...

class Check(_message.Message):
    __slots__ = ("answer_equals", "answer_integer_equals", "answer_matches", "file_exists", "file_contains", "file_sha256", "command_output_equals", "command_exit_code", "plugin", "timeout_s")
    ANSWER_EQUALS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_INTEGER_EQUALS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_MATCHES_FIELD_NUMBER: _ClassVar[int]
    FILE_EXISTS_FIELD_NUMBER: _ClassVar[int]
    FILE_CONTAINS_FIELD_NUMBER: _ClassVar[int]
    FILE_SHA256_FIELD_NUMBER: _ClassVar[int]
    COMMAND_OUTPUT_EQUALS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    PLUGIN_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    answer_equals: AnswerEquals
    answer_integer_equals: AnswerIntegerEquals
    answer_matches: AnswerMatches
    file_exists: FileExists
    file_contains: FileContains
    file_sha256: FileSha256
    command_output_equals: CommandOutputEquals
    command_exit_code: CommandExitCode
    plugin: PluginCheck
    timeout_s: float
    def __init__(self, answer_equals: _Optional[_Union[AnswerEquals, _Mapping]] = ..., answer_integer_equals: _Optional[_Union[AnswerIntegerEquals, _Mapping]] = ..., answer_matches: _Optional[_Union[AnswerMatches, _Mapping]] = ..., file_exists: _Optional[_Union[FileExists, _Mapping]] = ..., file_contains: _Optional[_Union[FileContains, _Mapping]] = ..., file_sha256: _Optional[_Union[FileSha256, _Mapping]] = ..., command_output_equals: _Optional[_Union[CommandOutputEquals, _Mapping]] = ..., command_exit_code: _Optional[_Union[CommandExitCode, _Mapping]] = ..., plugin: _Optional[_Union[PluginCheck, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "instruction", "setup", "env", "checks", "split", "tags", "max_turns", "source", "reference_solution", "template")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    SETUP_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_SOLUTION_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    instruction: str
    setup: str
    env: _containers.ScalarMap[str, str]
    checks: _containers.RepeatedCompositeFieldContainer[Check]
    split: Split
    tags: _containers.RepeatedScalarFieldContainer[str]
    max_turns: int
    source: str
    reference_solution: str
    template: str
    def __init__(self, task_id: _Optional[str] = ..., instruction: _Optional[str] = ..., setup: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., checks: _Optional[_Iterable[_Union[Check, _Mapping]]] = ..., split: _Optional[_Union[Split, str]] = ..., tags: _Optional[_Iterable[str]] = ..., max_turns: _Optional[int] = ..., source: _Optional[str] = ..., reference_solution: _Optional[str] = ..., template: _Optional[str] = ...) -> None: ...
