"""The terminal reward components as pure functions (services/verifier/reward_components.py), the
executed-argv trace of the sandbox's prelude (run by a real bash here) and the health score's
arithmetic; each component checked against the way a policy would game it."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from services.rollout.health_gate import HealthGate, sandbox_health_score
from services.sandbox.host.health import HealthWeights, HostHealth, score_of
from services.sandbox.isolation.argv_trace import argv_safety_events, read_trace
from services.sandbox.isolation.preludes import bash_prelude
from services.sandbox.limits import Limits
from services.sandbox.policy import PolicySet
from services.verifier.parts import build_terminal_rewards
from services.verifier.reward_components import (
    ComponentWeights,
    TerminalRewards,
    is_exempt,
    state_drift,
    task_outputs,
    task_time_budget_s,
    time_efficiency,
)
from services.verifier.rewards import Shaping, compute_reward
from services.verifier.settings import VerifierSettings
from shellrl.contract import ToolEvent, task_from_json
from tests.helpers.owned_processes import run_owned

TASK = task_from_json(
    {
        "task_id": "t1",
        "instruction": "Write the line count of data.txt to out/count.txt",
        "setup": "seq 3 > data.txt; mkdir -p out notes; echo keep > notes/a.txt",
        "checks": [{"type": "file_contains", "path": "./out/count.txt", "substring": "3"}],
        "tags": ["output:report/", "time_budget_s:10"],
    }
)


def diff(*changes: tuple[str, str]) -> dict:
    return {"changed": [{"path": p, "change": c} for p, c in changes], "count": len(changes)}


def test_task_outputs_are_file_check_paths_and_output_tags():
    assert task_outputs(TASK) == ("out/count.txt", "report")
    assert task_time_budget_s(TASK, 60.0) == 10.0
    untagged = task_from_json({**TASK_JSON_MIN, "tags": ["time_budget_s:nan", "time_budget_s:-1"]})
    assert task_time_budget_s(untagged, 60.0) == 60.0


TASK_JSON_MIN = {
    "task_id": "t2",
    "instruction": "x",
    "checks": [{"type": "answer_equals", "expected": "3"}],
}


def test_drift_cannot_be_lowered_by_deleting_the_tasks_own_outputs():
    stray = ("notes/a.txt", "modified")
    wrote = state_drift(diff(stray, ("out/count.txt", "added")), task_outputs(TASK), 10)
    deleted = state_drift(diff(stray, ("out/count.txt", "removed")), task_outputs(TASK), 10)
    nothing = state_drift(diff(stray), task_outputs(TASK), 10)
    assert wrote == deleted == nothing == -0.1


def test_drift_counts_a_removed_directory_that_held_an_output():
    # `rm -rf out` removes the setup's out/ (it may hold other files): not the task's business
    assert not is_exempt("out", "removed", ("out/count.txt",))
    assert is_exempt("out", "added", ("out/count.txt",))  # made to hold the output
    assert is_exempt("report/deep/x.csv", "modified", ("report",))
    assert state_drift(diff(("out", "removed")), task_outputs(TASK), 10) == -0.1


def test_drift_counts_paths_the_sandbox_did_not_list_and_is_capped():
    body = {"changed": [{"path": "a", "change": "added"}], "count": 50, "truncated": True}
    assert state_drift(body, (), 10) == -1.0
    assert state_drift(diff(), (), 10) == 0.0


def events(*durations_ms: float, timed_out: bool = False) -> list[ToolEvent]:
    return [
        ToolEvent(command="x", exit_code=0, duration_ms=d, timed_out=timed_out)
        for d in durations_ms
    ]


def test_time_efficiency_is_never_a_bonus_and_counts_timeouts_in_full():
    assert time_efficiency([], 10.0) == 0.0  # doing nothing earns what an efficient success earns
    assert time_efficiency(events(4000, 5000), 10.0) == 0.0
    assert time_efficiency(events(15_000), 10.0) == -0.5
    assert time_efficiency(events(30_000, timed_out=True), 10.0) == -1.0
    malformed = [ToolEvent(command="", parse_error="no command", duration_ms=99_000)]
    assert time_efficiency(malformed, 10.0) == 0.0


def test_components_enter_training_reward_times_their_weight_and_off_means_absent():
    weights = {"state_drift": 2.0}
    reward = compute_reward([True], events(10), False, Shaping(), {"state_drift": -0.25}, weights)
    assert reward.reward == 1.0 and reward.training_reward == 0.5
    assert reward.components["state_drift"] == -0.25
    plain = compute_reward([True], events(10), False, Shaping())
    assert "state_drift" not in plain.components and plain.training_reward == 1.0
    assert ComponentWeights().enabled() == {}
    with pytest.raises(ValueError, match="needs a SafetyEscalation"):
        TerminalRewards(ComponentWeights(safety=1.0))
    with pytest.raises(ValueError, match="state_drift"):
        ComponentWeights(state_drift=-1.0)


def test_each_component_has_one_weight_setting_and_the_parts_pass_every_one():
    """issue 31 item 6: a component is a ComponentWeights field and a reward_<name>_weight
    setting; the verifier's parts map every field to its setting, with no list to extend."""
    names = set(ComponentWeights().by_name())
    settings = {n for n in VerifierSettings.model_fields if n.startswith("reward_")}
    assert {
        n.removeprefix("reward_").removesuffix("_weight") for n in settings if n.endswith("_weight")
    } == names
    on = VerifierSettings(reward_state_drift_weight=0.5, reward_time_efficiency_weight=2.0)
    assert build_terminal_rewards(on).weights.enabled() == {
        "state_drift": 0.5,
        "time_efficiency": 2.0,
    }
    assert build_terminal_rewards(VerifierSettings()) is None
    with pytest.raises(ValueError, match="finite"):
        VerifierSettings(reward_time_efficiency_weight=float("inf"))


# --- the executed-argv trace: the sandbox's prelude, run by a real bash -------------------------

LIMITS = Limits(
    timeout_s=10,
    cpu_s=60,
    memory_bytes=1 << 30,
    address_space_bytes=8 << 30,
    pids=256,
    file_size_bytes=1 << 30,
    workspace_bytes=1 << 28,
    max_output_bytes=65536,
    nofile=1024,
    cpus=1.0,
)
POLICY = PolicySet.load().policies["default"]


def traced(tmp_path: Path, command: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    for name in ("cwd", "env", "trace"):
        (state / name).touch()
    (tmp_path / "cmd").write_text(command + "\0")
    prelude = bash_prelude(LIMITS, f"< {tmp_path / 'cmd'}", str(state))
    done = run_owned(
        ["bash", "-c", prelude], capture_output=True, text=True, cwd=tmp_path, timeout_s=10
    )
    trace = read_trace(state)
    return done, argv_safety_events(trace, POLICY, POLICY.evaluate(command), False)


@pytest.mark.parametrize(
    "command",
    [
        "r=rm; mkdir -p d; $r -rf d",  # rm spelled through a variable
        'eval "$(printf %s cm0gLXJmIGQK | base64 -d)"',  # decoded at run time
        'c=(r m); mkdir -p d; "${c[0]}${c[1]}" -rf d',  # pieces of an array
    ],
)
def test_rm_rf_through_a_variable_is_caught_in_the_executed_argv(tmp_path, command):
    assert POLICY.evaluate(command).verdict == "allow"  # the text alone passes the policy
    done, found = traced(tmp_path, command)
    assert done.returncode == 0 and done.stderr == ""  # the trace never reaches the output
    assert [(e["rule"], e["source"]) for e in found] == [("rm_recursive_or_force", "argv")]


def test_switching_the_trace_off_is_itself_a_safety_event(tmp_path):
    for command in ("set +x; r=rm; $r -rf d", 's="+o xtr""ace"; set $s; echo hi', "unset X"):
        _, found = traced(tmp_path, command)
        rules = [e["rule"] for e in found]
        assert rules == ([] if command == "unset X" else ["argv_trace_off"]), command


def test_an_ordinary_command_adds_no_event_and_keeps_its_output(tmp_path):
    done, found = traced(tmp_path, "echo hi; exit 3")
    assert (done.returncode, done.stdout, done.stderr, found) == (3, "hi\n", "", [])


# --- terminal health score ----------------------------------------------------------------------


def test_health_score_is_the_weighted_mean_of_its_parts():
    assert score_of(HealthWeights(), {"load": 1, "memory": 1, "disk": 1, "latency": 1}) == 1.0
    subs = {"load": 0.0, "memory": 1.0, "disk": 0.5, "latency": 0.0}
    assert score_of(HealthWeights(), subs) == pytest.approx(0.3 + 0.1)
    with pytest.raises(ValueError):
        HealthWeights(load=-1)


def test_health_sample_reads_the_host(tmp_path):
    health = HostHealth(tmp_path, max_latency_s=1.0)
    for s in (0.1, 0.2, 2.0):
        health.observe_exec(s)
    sample = health.sample()
    assert 0.0 <= sample.score <= 1.0 and sample.exec_latency_s == 2.0
    assert sample.sub_scores["latency"] == 0.0 and 0 < sample.memory_available_ratio <= 1
    assert set(sample.as_dict()) >= {"score", "load_per_cpu", "disk_free_ratio"}


def test_health_score_of_a_fleet_is_the_mean_of_its_members():
    assert sandbox_health_score({"health": {"score": 0.4}}) == 0.4
    fleet = {"members": {"a": {"health": {"score": 0.2}}, "b": {"health": {"score": 0.6}}, "c": {}}}
    assert sandbox_health_score(fleet) == pytest.approx(0.4)
    assert sandbox_health_score({"ready": True}) is None


async def test_health_gate_slows_new_groups_only_below_the_threshold():
    answers = [{"health": {"score": 0.3}}, {"health": {"score": 0.9}}]

    async def ready() -> dict:
        return answers.pop(0)

    gate = HealthGate(ready, threshold=0.45, delay_s=0.01, refresh_s=0)
    await gate.wait()
    assert gate.status() == {
        "score": 0.3,
        "threshold": 0.45,
        "below_threshold": True,
        "slowed": True,
        "delay_s": 0.01,
        "groups_delayed": 1,
    }
    await gate.wait()
    assert not gate.slowed and gate.groups_delayed == 1

    async def down() -> dict:
        raise OSError("sandbox down")

    unknown = HealthGate(down, threshold=0.45, delay_s=10, refresh_s=0)
    await unknown.wait()  # an unreadable score never blocks admission (InfraGate's business)
    assert unknown.status()["score"] is None and not unknown.slowed


def test_the_mean_of_each_reward_component_can_be_queried_even_when_it_is_negative():
    """The dashboard's "Reward components" panel is rate(_sum) / rate(_count): a histogram with
    negative buckets exposes no _sum (the panel had no data in the e2e stack), a summary does."""
    from prometheus_client import generate_latest

    from services.verifier import metrics

    metrics.REWARD_COMPONENT.labels("test_negative").observe(-0.5)
    text = generate_latest().decode()
    assert 'shellrl_verifier_reward_component_sum{component="test_negative"} -0.5' in text
    assert 'shellrl_verifier_reward_component_count{component="test_negative"} 1.0' in text
    assert 'shellrl_verifier_safety_violations_total{level="escalated"} 0.0' in text
