"""KL to the initial policy per task template (issue 33 item 1), for the step record.

Consumes a step's trained groups (each member's Trajectory carries the task it ran, hence its
template; a trajectory written without `task` falls back to its task id, see
shellrl.contract.template_of) and the trainer's per-row KL sums (`StepResult.row_kl`: the k3
estimate of KL(pi || ref) summed over a row's scored tokens, under the weights the step started
from). Produces `{template: {"kl": mean per scored token, "tokens": int, "trajectories": int}}`,
which the worker puts into the step's record (steps.jsonl, the tracker, /v1/status) as
`kl_by_template`. Empty without a reference policy (kl_coef = 0).
"""

from __future__ import annotations

from shellrl.contract import template_of


def trajectory_template(trajectory) -> str:
    """The template of a Trajectory message (its task's, else parsed from its task id)."""
    if trajectory.HasField("task"):
        task = trajectory.task
        return template_of(trajectory.task_id or task.task_id, task.template, task.source)
    return template_of(trajectory.task_id)


def kl_by_template(groups, row_kl) -> dict[str, dict]:
    """groups: the step's RolloutGroups; row_kl: [(trajectory_id, kl_sum, tokens)]. Rows whose
    trajectory is in no group (none today) are left out."""
    templates = {
        m.trajectory_id: trajectory_template(m.trajectory) for g in groups for m in g.members
    }
    sums: dict[str, list] = {}
    for trajectory_id, kl, tokens in row_kl:
        if trajectory_id in templates:
            acc = sums.setdefault(templates[trajectory_id], [0.0, 0, 0])
            acc[0], acc[1], acc[2] = acc[0] + kl, acc[1] + tokens, acc[2] + 1
    return {
        t: {"kl": kl / tokens if tokens else 0.0, "tokens": tokens, "trajectories": n}
        for t, (kl, tokens, n) in sorted(sums.items())
    }
