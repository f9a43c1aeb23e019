"""Typed Python views of the protobuf data contract (proto/shellrl/v1). The only package that
touches the generated `*_pb2` code; services import messages and helpers from here:

  trajectory.py  per-token arrays, segments, TrajectoryArrays, parse_trajectory
  tasks.py       tasks in JSON form: parse and validate, serialize, JSONL
  failures.py    Failure classes and the one INFRA rule (`is_infra`)
  exec.py        ExecResult: one sandbox command's outcome (server and clients)
  errors.py      ContractError, TaskValidationError

Glossary (one word per concept, DESIGN.md section 4):
  task            a shell problem: instruction, setup script, typed checks, split.
  trajectory      one episode of one task: prompt_ids, then segments; scored by the verifier.
  segment         one model call (ACTION: engine-sampled tokens, loss mask 1, behavior log-probs,
                  policy_version) or the harness text after it (OBSERVATION: loss mask 0).
  group           the G trajectories of one task sampled together for GRPO (`group_id`).
  policy_version  number of optimizer steps the weights have taken (engine `weight_version`).
  staleness       learner_version - min(policy_version of a trajectory's ACTION segments).
  behavior_logprobs  log-probs the engine sampled with; proximal_logprobs: the learner's at
                  the start of a step; logprobs: the learner's current ones.

Wire form of per-token arrays: raw little-endian bytes (int32 token ids, float32 log-probs,
uint8 loss mask), see trajectory.proto. Decoders validate byte lengths and raise ValueError.
"""

from shellrl.contract.errors import ContractError, TaskValidationError
from shellrl.contract.exec import ExecResult, PolicyVerdict
from shellrl.contract.failures import (
    INFRA_FAILURES,
    RERUN_FAILURES,
    failure_label,
    is_infra,
    is_rerun,
)
from shellrl.contract.tasks import (
    CHECK_TYPES,
    LIMITS,
    SPLIT_NAMES,
    check_from_json,
    check_to_json,
    iter_tasks_jsonl,
    split_from_name,
    split_name,
    task_from_json,
    task_to_json,
    template_of,
)
from shellrl.contract.trajectory import (
    ACTION,
    OBSERVATION,
    TrajectoryArrays,
    action_segment,
    decode_logprobs,
    decode_loss_mask,
    decode_token_ids,
    encode_logprobs,
    encode_loss_mask,
    encode_token_ids,
    min_policy_version,
    observation_segment,
    parse_trajectory,
    trajectory_arrays,
)
from shellrl.v1.task_pb2 import (
    AnswerEquals,
    AnswerIntegerEquals,
    AnswerMatches,
    Check,
    CommandExitCode,
    CommandOutputEquals,
    FileContains,
    FileExists,
    FileSha256,
    Split,
    Task,
)
from shellrl.v1.trajectory_pb2 import (
    EpisodeEnd,
    Failure,
    FinishReason,
    SamplingParams,
    Segment,
    SegmentKind,
    ToolEvent,
    Trajectory,
)

__all__ = [
    "AnswerEquals",
    "AnswerIntegerEquals",
    "AnswerMatches",
    "Check",
    "CommandExitCode",
    "CommandOutputEquals",
    "FileContains",
    "FileExists",
    "FileSha256",
    "Split",
    "Task",
    "EpisodeEnd",
    "Failure",
    "FinishReason",
    "SamplingParams",
    "Segment",
    "SegmentKind",
    "ToolEvent",
    "Trajectory",
    "ContractError",
    "TaskValidationError",
    "ExecResult",
    "PolicyVerdict",
    "INFRA_FAILURES",
    "RERUN_FAILURES",
    "failure_label",
    "is_infra",
    "is_rerun",
    "ACTION",
    "OBSERVATION",
    "LIMITS",
    "SPLIT_NAMES",
    "encode_token_ids",
    "decode_token_ids",
    "encode_logprobs",
    "decode_logprobs",
    "encode_loss_mask",
    "decode_loss_mask",
    "action_segment",
    "observation_segment",
    "TrajectoryArrays",
    "trajectory_arrays",
    "min_policy_version",
    "parse_trajectory",
    "task_from_json",
    "task_to_json",
    "template_of",
    "check_from_json",
    "check_to_json",
    "iter_tasks_jsonl",
    "CHECK_TYPES",
    "split_name",
    "split_from_name",
]
