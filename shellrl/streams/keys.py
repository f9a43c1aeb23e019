"""Every Redis key, stream, group and channel name of shellrl, in one place (DESIGN.md section 3).

Streams carry protobuf entries between services; the other keys are small state a service keeps
in Redis (its owner named beside each). Nothing else in the tree spells a `shellrl:` key.
"""

from __future__ import annotations

STREAM_TASKS = "shellrl:tasks"
STREAM_EPISODES = "shellrl:episodes"
STREAM_TRAJECTORIES = "shellrl:trajectories"
STREAM_DEAD = "shellrl:dead"
POLICY_VERSION_KEY = "shellrl:policy:version"
POLICY_UPDATES_CHANNEL = "shellrl:policy:updates"
STREAM_EVALUATIONS = (
    "shellrl:evaluations"  # scored eval trajectories (Trajectory.eval = true), by the verifier
)
STREAM_EGRESS = "shellrl:egress"  # audit: every verdict of the sandbox's egress proxy (by it)
GROUP_ROLLOUT, GROUP_VERIFIER, GROUP_LEARNER = "rollout", "verifier", "learner"

# the rollout gateway's state
TASK_INDEX_KEY = "shellrl:tasks:index"  # sorted set: task ids by submission sequence
TASK_SEQ_KEY = "shellrl:tasks:seq"  # counter behind TASK_INDEX_KEY
POOL_KEY = "shellrl:rollout:pool"  # set: task ids in the training pool
EPOCH_KEY = "shellrl:rollout:epoch"  # current epoch number
ORDER_KEY = "shellrl:rollout:epoch:order"  # list: this epoch's remaining task order
ADMITTED_KEY = "shellrl:rollout:groups_admitted"  # groups admitted so far (staleness bound)
INFLIGHT_KEY = "shellrl:rollout:inflight"  # sorted set: admitted groups not yet finished
REPLICAS_KEY = "shellrl:rollout:replicas"  # sorted set: replica name -> last heartbeat (unix s)
EVALUATION_INDEX_KEY = "shellrl:evaluations:index"  # evaluations by start time
RUN_INDEX_KEY = "shellrl:runs:index"  # sorted set: training runs (POST /v1/runs) by start time
ACTIVE_RUN_KEY = "shellrl:runs:active"  # string: id of the run training now (none: no key)
RUN_START_LOCK_KEY = "shellrl:runs:starting"  # string, short-lived: a run being started

# engines: each registers itself (shellrl.clients.engine_registry); the learner says what it did
ENGINES_KEY = "shellrl:engines"  # hash: engine url -> JSON EngineRegistration (by the engine)
ENGINE_SYNC_KEY = "shellrl:engines:sync"  # hash: engine url -> JSON EngineState (by the learner)
SANDBOXES_KEY = "shellrl:sandboxes"  # hash: sandbox url -> JSON SandboxRegistration (by each)
LEARNER_LOCK_KEY = "shellrl:learner:lock"  # string: JSON of the one learner running (its rank 0)


def task_key(task_id: str) -> str:
    return f"shellrl:task:{task_id}"


def idempotency_key(stream: str, key: str) -> str:
    return f"shellrl:idem:{stream}:{key}"


def evaluation_key(evaluation_id: str) -> str:
    """Hash of one evaluation's meta and state; its results list is this key + ":results"."""
    return f"shellrl:evaluation:{evaluation_id}"


def run_key(run_id: str) -> str:
    """Hash of one training run (services/rollout/runs.py); its task ids: this key + ":tasks"."""
    return f"shellrl:run:{run_id}"


def errors_key(stream: str, group: str) -> str:
    """Failure counts per entry of `group` on `stream` (StreamConsumer.fail)."""
    return f"shellrl:errors:{stream}:{group}"


def attempts_key(stream: str, group: str) -> str:
    """Handling attempts per entry of `group` on `stream` (StreamConsumer deliveries)."""
    return f"shellrl:attempts:{stream}:{group}"


def lost_key(stream: str) -> str:
    """Hash of `stream`: group -> pending entries of that group trimmed away before they were
    handled (StreamConsumer; shown by `shellrl status`)."""
    return f"shellrl:lost:{stream}"


def taken_key(replica: str) -> str:
    """List of the task ids rollout replica `replica` took from the epoch order and has not yet
    handed off as a group (oldest first; task_pool.TaskPool)."""
    return f"shellrl:rollout:taken:{replica}"


def template_outcomes_key(template: str) -> str:
    """List of one template's latest training outcomes ("1" success, "0" not; newest first,
    capped), by the rollout gateway's pass-rate steering (services/rollout/steering.py)."""
    return f"shellrl:rollout:template:{template}:outcomes"


def group_accounting_key(group_id: str) -> str:
    """Hash of one admitted group, by the rollout gateway: `usable` (members not INFRA at hand-off),
    `lost` (members the verifier then failed with INFRA), `given_back` (admission returned), and
    the reward keys of its scored members for dynamic sampling (`arrived`, `key`, `varied`)."""
    return f"shellrl:rollout:group:{group_id}"


def safety_escalation_key(run: str) -> str:
    """Hash of one run's escalating safety penalty, by the verifier (reward_components.py):
    `streak` (commands since the last violation), `violations`; the violation log is this key +
    ":violations" (list, newest first, capped) and an episode's recorded penalty this key +
    ":episode:<trajectory_id>" (string, kept a day: a re-delivered episode is not counted twice)."""
    return f"shellrl:verifier:safety:{run}"
