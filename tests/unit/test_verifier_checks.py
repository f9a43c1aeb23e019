"""Pure semantics of the answer checks and the reward function (services/verifier)."""

from __future__ import annotations

import math

import pytest

from services.verifier.answer_checks import (
    answer_equals,
    answer_integer_equals,
    answer_matches,
    norm,
)
from services.verifier.checks import CheckLimits, run_check
from services.verifier.rewards import Shaping, compute_reward, safety_flagged
from shellrl.contract import ToolEvent, check_from_json


def test_norm_converts_crlf_and_cr_then_strips():
    assert norm("  a\r\nb\rc \n") == "a\nb\nc"


@pytest.mark.parametrize(
    "answer, expected, ci, passed",
    [
        ("linux", "linux", False, True),
        ("  linux\r\n", "linux", False, True),
        ("Linux", "linux", False, False),
        ("Linux", "linux", True, True),
        ("a\r\nb", "a\nb", False, True),
        ("linux extra", "linux", False, False),
        ("", "linux", False, False),
    ],
)
def test_answer_equals_normalises_line_endings_and_surrounding_whitespace(
    answer, expected, ci, passed
):
    assert answer_equals(answer, expected, ci)[0] is passed


@pytest.mark.parametrize(
    "answer, passed",
    [
        ("5", True),
        (" 5\n", True),
        ("+5", True),
        ("05", True),
        ("-5", False),
        ("6", False),
        ("5.0", False),
        ("1_0", False),
        ("five", False),
        ("5 apples", False),
        ("", False),
        ("٥", False),
    ],
)
def test_answer_integer_equals_accepts_only_ascii_integers(answer, passed):
    assert answer_integer_equals(answer, 5)[0] is passed


def test_answer_integer_equals_handles_negative_zero_and_large_values():
    assert answer_integer_equals("-12", -12)[0] and not answer_integer_equals("12", -12)[0]
    assert answer_integer_equals("-0", 0)[0] and answer_integer_equals("+000", 0)[0]
    assert answer_integer_equals(str(2**62), 2**62)[0]


def test_answer_of_100k_digits_fails_instead_of_raising():
    # int() refuses more than 4300 digits; the check must still answer
    assert not answer_integer_equals("9" * 100_000, 5)[0]
    assert answer_integer_equals("0" * 100_000 + "5", 5)[0]


@pytest.mark.parametrize(
    "answer, pattern, passed",
    [
        ("abc123", r"[a-z]+\d+", True),
        ("xabc123", r"[a-z]{3}\d+", False),  # full match, not re.search (issue 6)
        ("abc123 tail", r"[a-z]+\d+", False),
        ("  abc123\n", r"[a-z]+\d+", True),  # norm() first
    ],
)
def test_answer_matches_is_a_full_match_of_the_normalised_answer(answer, pattern, passed):
    assert answer_matches(answer, pattern, False, 1.0)[0] is passed


def test_answer_matches_case_insensitive_flag():
    assert answer_matches("ABC", "abc", True, 1.0)[0]
    assert not answer_matches("ABC", "abc", False, 1.0)[0]


def test_catastrophic_regex_fails_within_its_timeout_instead_of_hanging():
    passed, detail = answer_matches("a" * 40 + "!", r"(a|aa)+$", False, 0.2)
    assert not passed and "ran past" in detail


async def test_no_final_answer_fails_answer_checks():
    result = await run_check(
        check_from_json({"type": "answer_equals", "expected": "x"}), None, None, CheckLimits()
    )
    assert not result.passed and result.detail == "no final answer"


async def test_overlong_answer_fails():
    check = check_from_json({"type": "answer_equals", "expected": "x"})
    result = await run_check(check, "x" * 20, None, CheckLimits(max_answer_chars=10))
    assert not result.passed


async def test_workspace_check_without_a_session_cannot_run():
    from services.verifier.workspace_checks import CheckInfraError

    with pytest.raises(CheckInfraError):
        await run_check(
            check_from_json({"type": "file_exists", "path": "a"}), "x", None, CheckLimits()
        )


def _events(*specs) -> list[ToolEvent]:
    return [
        ToolEvent(command="c", exit_code=code, timed_out=timed_out, policy_verdict=verdict)
        for code, timed_out, verdict in specs
    ]


def test_reward_is_one_only_when_every_check_passes():
    assert compute_reward([True, True], [], False, Shaping()).reward == 1.0
    assert compute_reward([True, False], [], False, Shaping()).reward == 0.0
    with pytest.raises(ValueError):
        compute_reward([], [], False, Shaping())


def test_shaping_components_are_reported_but_not_trained_on_by_default():
    events = _events(
        (0, False, "allow"), (0, False, "allow"), (1, False, "allow"), (-1, True, "allow")
    )
    r = compute_reward([False], events, False, Shaping())
    assert r.components == pytest.approx(
        {
            "outcome": 0.0,
            "exit_zero_bonus": 0.2,
            "timeout_penalty": -0.1,
            "safety_penalty": 0.0,
            "ungrounded_success": 0.0,
        }
    )
    assert r.training_reward == 0.0


def test_enabled_shaping_caps_the_exit_zero_bonus_and_adds_penalties():
    events = _events(*[(0, False, "allow")] * 5, (-1, True, "allow"))
    r = compute_reward([True], events, True, Shaping(enabled=True))
    assert r.components["exit_zero_bonus"] == pytest.approx(0.3)
    assert r.training_reward == pytest.approx(1.0 + 0.3 - 0.1 - 1.0)
    assert r.reward == 1.0


def test_a_success_without_any_command_trains_as_zero_only_when_require_command_is_on():
    """run6's collapse: lucky `<answer>N</answer>` guesses were trained on as successes."""
    guess = compute_reward([True], [], False, Shaping())
    assert (guess.reward, guess.training_reward, guess.components["ungrounded_success"]) == (
        1.0,
        1.0,
        -1.0,
    )
    guess = compute_reward([True], [], False, Shaping(require_command=True))
    assert (guess.reward, guess.training_reward) == (1.0, 0.0)
    malformed_only = [ToolEvent(exit_code=0, parse_error="no <bash> tag")]  # not a command
    assert (
        compute_reward([True], malformed_only, False, Shaping(require_command=True)).training_reward
        == 0.0
    )
    denied_only = _events((-1, False, "deny"))  # sent, but it never ran
    assert (
        compute_reward([True], denied_only, False, Shaping(require_command=True)).training_reward
        == 0.0
    )
    looked_up = compute_reward(
        [True], _events((0, False, "allow")), False, Shaping(require_command=True)
    )
    assert (looked_up.training_reward, looked_up.components["ungrounded_success"]) == (1.0, 0.0)
    failed = compute_reward([False], [], False, Shaping(require_command=True))
    assert (
        failed.training_reward == 0.0 and str(failed.components["ungrounded_success"]) == "0.0"
    )  # never -0.0
    with_shaping = compute_reward([True], [], False, Shaping(enabled=True, require_command=True))
    assert with_shaping.training_reward == 0.0


def test_malformed_actions_are_not_commands_for_shaping():
    events = [ToolEvent(exit_code=0, parse_error="no <bash> tag")]
    assert compute_reward([True], events, False, Shaping()).components["exit_zero_bonus"] == 0.0


def test_flagged_or_denied_commands_are_safety_events():
    assert safety_flagged(_events((0, False, "flag")))
    assert safety_flagged(_events((-1, False, "deny")))
    assert not safety_flagged(_events((0, False, "allow")))
    assert safety_flagged([], [{"rule": "rm_rf_workspace"}])


def test_non_finite_shaping_weights_are_refused():
    with pytest.raises(ValueError):
        Shaping(exit_zero_bonus=math.nan)


def test_an_unscored_verification_writes_nan_and_its_failure_only_into_its_own_trajectory():
    from services.verifier.rewards import Reward
    from services.verifier.verification import Verification
    from shellrl.contract import Failure, Trajectory

    members = [Trajectory(trajectory_id=f"t{i}", group_id="g") for i in range(3)]
    ok = Verification((), Reward(1.0, 1.0, {"outcome": 1.0}))
    failed = Verification((), None, Failure.FAILURE_INFRA_VERIFIER, "sandbox gone")
    for traj, result in zip(members, (ok, failed, ok)):
        result.apply_to(traj)
    assert [t.scored for t in members] == [True, False, True]
    assert members[0].reward == members[2].reward == 1.0 and members[0].training_reward == 1.0
    assert math.isnan(members[1].reward) and math.isnan(members[1].training_reward)
    assert members[1].failure == Failure.FAILURE_INFRA_VERIFIER and not members[1].reward_components
    assert failed.to_json()["reward"] is None and failed.to_json()["failure"] == "infra_verifier"


def test_the_per_check_results_are_written_into_the_trajectory_and_replaced_on_rescoring():
    from services.rollout.evaluations import apply_verdict
    from services.verifier.checks import CheckResult
    from services.verifier.rewards import Reward
    from services.verifier.verification import Verification
    from shellrl.contract import Trajectory, parse_trajectory
    from shellrl.contract.trajectory import CHECK_DETAIL_CHARS

    checks = (
        CheckResult("answer_integer_equals", True, "5 == 5", 0.25),
        CheckResult("file_exists", False, "x" * 5_000, 3.5),
    )
    traj = Trajectory(trajectory_id="t0")
    Verification(checks, Reward(0.0, 0.0, {"outcome": 0.0})).apply_to(traj)
    back = parse_trajectory(traj.SerializeToString())
    assert [(c.type, c.passed, c.duration_ms) for c in back.checks] == [
        ("answer_integer_equals", True, 0.25),
        ("file_exists", False, 3.5),
    ]
    assert back.checks[0].detail == "5 == 5" and len(back.checks[1].detail) == CHECK_DETAIL_CHARS
    Verification((), None, 3, "sandbox gone").apply_to(traj)  # a re-score that could not run
    assert not traj.checks
    verdict = {"reward": 1.0, "checks": [c.to_json() for c in checks[:1]], "verifier_version": "v"}
    apply_verdict(traj, verdict)  # a stored evaluation episode, from POST /v1/verify's JSON
    assert [(c.type, c.passed, c.detail) for c in traj.checks] == [
        ("answer_integer_equals", True, "5 == 5")
    ]


def test_a_plugin_check_type_that_cannot_be_loaded_is_listed_with_its_error(monkeypatch):
    from importlib.metadata import EntryPoint

    from services.verifier import plugin_checks
    from shellrl import plugins

    broken = {"broken_check": EntryPoint("broken_check", "no_such_module:Check", plugins.CHECKS)}
    monkeypatch.setattr(plugins, "available", lambda group: broken)  # fault: a missing module
    monkeypatch.setattr(plugin_checks, "available", lambda group: broken)
    [listed] = plugin_checks.plugin_check_types()
    assert (listed["type"], listed["entry_point"]) == ("broken_check", "no_such_module:Check")
    assert "cannot be loaded" in listed["error"] and "parameters" not in listed
