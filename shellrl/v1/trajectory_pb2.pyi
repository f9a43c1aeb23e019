from shellrl.v1 import task_pb2 as _task_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SegmentKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEGMENT_KIND_UNSPECIFIED: _ClassVar[SegmentKind]
    SEGMENT_KIND_ACTION: _ClassVar[SegmentKind]
    SEGMENT_KIND_OBSERVATION: _ClassVar[SegmentKind]

class Failure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_NONE: _ClassVar[Failure]
    FAILURE_INFRA_ENGINE: _ClassVar[Failure]
    FAILURE_INFRA_SANDBOX: _ClassVar[Failure]
    FAILURE_INFRA_VERIFIER: _ClassVar[Failure]
    FAILURE_TIMEOUT_BUDGET: _ClassVar[Failure]
    FAILURE_INFRA_ROLLOUT: _ClassVar[Failure]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class EpisodeEnd(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EPISODE_END_UNSPECIFIED: _ClassVar[EpisodeEnd]
    EPISODE_END_ANSWER: _ClassVar[EpisodeEnd]
    EPISODE_END_MAX_TURNS: _ClassVar[EpisodeEnd]
    EPISODE_END_CONTEXT: _ClassVar[EpisodeEnd]
    EPISODE_END_FAILURE: _ClassVar[EpisodeEnd]
SEGMENT_KIND_UNSPECIFIED: SegmentKind
SEGMENT_KIND_ACTION: SegmentKind
SEGMENT_KIND_OBSERVATION: SegmentKind
FAILURE_NONE: Failure
FAILURE_INFRA_ENGINE: Failure
FAILURE_INFRA_SANDBOX: Failure
FAILURE_INFRA_VERIFIER: Failure
FAILURE_TIMEOUT_BUDGET: Failure
FAILURE_INFRA_ROLLOUT: Failure
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
EPISODE_END_UNSPECIFIED: EpisodeEnd
EPISODE_END_ANSWER: EpisodeEnd
EPISODE_END_MAX_TURNS: EpisodeEnd
EPISODE_END_CONTEXT: EpisodeEnd
EPISODE_END_FAILURE: EpisodeEnd

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class ToolEvent(_message.Message):
    __slots__ = ("command", "exit_code", "duration_ms", "timed_out", "stdout_truncated_bytes", "stderr_truncated_bytes", "policy_verdict", "policy_rule", "parse_error")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    STDOUT_TRUNCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    STDERR_TRUNCATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERDICT_FIELD_NUMBER: _ClassVar[int]
    POLICY_RULE_FIELD_NUMBER: _ClassVar[int]
    PARSE_ERROR_FIELD_NUMBER: _ClassVar[int]
    command: str
    exit_code: int
    duration_ms: float
    timed_out: bool
    stdout_truncated_bytes: int
    stderr_truncated_bytes: int
    policy_verdict: str
    policy_rule: str
    parse_error: str
    def __init__(self, command: _Optional[str] = ..., exit_code: _Optional[int] = ..., duration_ms: _Optional[float] = ..., timed_out: _Optional[bool] = ..., stdout_truncated_bytes: _Optional[int] = ..., stderr_truncated_bytes: _Optional[int] = ..., policy_verdict: _Optional[str] = ..., policy_rule: _Optional[str] = ..., parse_error: _Optional[str] = ...) -> None: ...

class CheckResult(_message.Message):
    __slots__ = ("type", "passed", "detail", "duration_ms")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    type: str
    passed: bool
    detail: str
    duration_ms: float
    def __init__(self, type: _Optional[str] = ..., passed: _Optional[bool] = ..., detail: _Optional[str] = ..., duration_ms: _Optional[float] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("kind", "policy_version", "token_ids", "logprobs", "loss_mask", "finish_reason", "request_id", "sampling", "tool_event", "turn")
    KIND_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TOOL_EVENT_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    kind: SegmentKind
    policy_version: int
    token_ids: bytes
    logprobs: bytes
    loss_mask: bytes
    finish_reason: FinishReason
    request_id: str
    sampling: SamplingParams
    tool_event: ToolEvent
    turn: int
    def __init__(self, kind: _Optional[_Union[SegmentKind, str]] = ..., policy_version: _Optional[int] = ..., token_ids: _Optional[bytes] = ..., logprobs: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., request_id: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., tool_event: _Optional[_Union[ToolEvent, _Mapping]] = ..., turn: _Optional[int] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "task_id", "group_id", "attempt", "env_version", "harness_version", "verifier_version", "prompt_ids", "segments", "reward", "reward_components", "terminated", "truncated", "failure", "failure_detail", "sandbox_session_id", "answer", "end", "scored", "eval", "evaluation_id", "created_at", "finished_at", "scored_at", "group_size", "split", "source", "safety_events", "num_turns", "task", "admitted_at", "training_reward", "checks")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    ENV_VERSION_FIELD_NUMBER: _ClassVar[int]
    HARNESS_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    TERMINATED_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SCORED_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    SCORED_AT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SAFETY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    TRAINING_REWARD_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    task_id: str
    group_id: str
    attempt: int
    env_version: str
    harness_version: str
    verifier_version: str
    prompt_ids: bytes
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    terminated: bool
    truncated: bool
    failure: Failure
    failure_detail: str
    sandbox_session_id: str
    answer: str
    end: EpisodeEnd
    scored: bool
    eval: bool
    evaluation_id: str
    created_at: float
    finished_at: float
    scored_at: float
    group_size: int
    split: str
    source: str
    safety_events: _containers.RepeatedScalarFieldContainer[str]
    num_turns: int
    task: _task_pb2.Task
    admitted_at: float
    training_reward: float
    checks: _containers.RepeatedCompositeFieldContainer[CheckResult]
    def __init__(self, trajectory_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., attempt: _Optional[int] = ..., env_version: _Optional[str] = ..., harness_version: _Optional[str] = ..., verifier_version: _Optional[str] = ..., prompt_ids: _Optional[bytes] = ..., segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., terminated: _Optional[bool] = ..., truncated: _Optional[bool] = ..., failure: _Optional[_Union[Failure, str]] = ..., failure_detail: _Optional[str] = ..., sandbox_session_id: _Optional[str] = ..., answer: _Optional[str] = ..., end: _Optional[_Union[EpisodeEnd, str]] = ..., scored: _Optional[bool] = ..., eval: _Optional[bool] = ..., evaluation_id: _Optional[str] = ..., created_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., scored_at: _Optional[float] = ..., group_size: _Optional[int] = ..., split: _Optional[str] = ..., source: _Optional[str] = ..., safety_events: _Optional[_Iterable[str]] = ..., num_turns: _Optional[int] = ..., task: _Optional[_Union[_task_pb2.Task, _Mapping]] = ..., admitted_at: _Optional[float] = ..., training_reward: _Optional[float] = ..., checks: _Optional[_Iterable[_Union[CheckResult, _Mapping]]] = ...) -> None: ...
