"""Every check type against a real sandbox service: a passing, a failing and a hostile case each;
the seed tasks; INFRA failures that must never become a reward of 0."""

from __future__ import annotations

import contextlib
import time

import pytest

from services.verifier.parts import build_verifier
from services.verifier.settings import VerifierSettings
from shellrl.clients.sandbox import SandboxClient, SandboxNotFound
from shellrl.contract import Failure, task_from_json
from tasksets.seeds import SHA256_WITH_NEWLINE, WRONG_ANSWERS, seed_tasks
from tests.helpers.redis_server import free_port

pytestmark = pytest.mark.slow


@pytest.fixture
async def sandbox(sandbox_url):
    async with SandboxClient(sandbox_url) as client:
        yield client


@pytest.fixture
def verifier(sandbox, sandbox_url):
    return build_verifier(
        VerifierSettings(
            sandbox_url=sandbox_url, worker_enabled=False, check_timeout_s=5, max_file_bytes=1 << 20
        ),
        sandbox,
    )


@contextlib.asynccontextmanager
async def episode(
    sandbox, setup: str = "", commands: tuple[str, ...] = (), env: dict | None = None, limits=None
):
    """A session after setup and the agent's `commands`; deleted afterwards."""
    session = await sandbox.create_session(setup=setup, env=env or {}, limits=limits)
    sid = session["session_id"]
    try:
        for command in commands:
            await sandbox.exec(sid, command, timeout_s=10)
        yield sid
    finally:
        with contextlib.suppress(SandboxNotFound):
            await sandbox.delete(sid)


def task(*checks, setup: str = "", env: dict | None = None):
    return task_from_json(
        {
            "task_id": "t",
            "instruction": "x",
            "setup": setup,
            "env": env or {},
            "check": list(checks),
        }
    )


async def outcome(verifier, t, answer, sid):
    result = await verifier.verify(t, answer, sid)
    assert result.failure == Failure.FAILURE_NONE, result.failure_detail
    return result.reward.reward, result.checks


# --- file_exists -------------------------------------------------------------------------------


async def test_file_exists_passes_for_a_file_the_agent_created(sandbox, verifier):
    t = task({"type": "file_exists", "path": "out/result.txt"})
    async with episode(sandbox, commands=("mkdir out && echo 1 > out/result.txt",)) as sid:
        assert (await outcome(verifier, t, None, sid))[0] == 1.0


async def test_file_exists_fails_when_missing_or_of_the_wrong_kind(sandbox, verifier):
    async with episode(sandbox, commands=("mkdir d",)) as sid:
        assert (
            await outcome(verifier, task({"type": "file_exists", "path": "nope.txt"}), None, sid)
        )[0] == 0.0
        assert (await outcome(verifier, task({"type": "file_exists", "path": "d"}), None, sid))[
            0
        ] == 0.0
        assert (
            await outcome(
                verifier, task({"type": "file_exists", "path": "d", "directory": True}), None, sid
            )
        )[0] == 1.0


async def test_file_exists_fails_for_a_symlink_leaving_the_workspace(sandbox, verifier):
    t = task({"type": "file_exists", "path": "passwd"})
    async with episode(sandbox, commands=("ln -s /etc/passwd passwd", "ln -s ../.. up")) as sid:
        reward, checks = await outcome(verifier, t, None, sid)
        assert reward == 0.0 and "leaves the workspace" in checks[0].detail
        assert (
            await outcome(
                verifier, task({"type": "file_exists", "path": "up/etc/passwd"}), None, sid
            )
        )[0] == 0.0


# --- file_contains -----------------------------------------------------------------------------


async def test_file_contains_substring_and_regex(sandbox, verifier):
    async with episode(sandbox, commands=("printf 'alpha\\nbeta 42\\n' > f.txt",)) as sid:
        assert (
            await outcome(
                verifier,
                task({"type": "file_contains", "path": "f.txt", "substring": "beta 4"}),
                None,
                sid,
            )
        )[0] == 1.0
        assert (
            await outcome(
                verifier,
                task({"type": "file_contains", "path": "f.txt", "regex": r"^beta \d+$"}),
                None,
                sid,
            )
        )[0] == 0.0
        assert (
            await outcome(
                verifier,
                task({"type": "file_contains", "path": "f.txt", "regex": r"(?m)^beta \d+$"}),
                None,
                sid,
            )
        )[0] == 1.0
        assert (
            await outcome(
                verifier,
                task({"type": "file_contains", "path": "f.txt", "substring": "gamma"}),
                None,
                sid,
            )
        )[0] == 0.0


async def test_file_contains_refuses_a_symlink_escape(sandbox, verifier):
    # /etc/passwd (host and sandbox) contains "root"; the check must not read through the link
    t = task({"type": "file_contains", "path": "out.txt", "substring": "root"})
    async with episode(sandbox, commands=("ln -s /etc/passwd out.txt",)) as sid:
        reward, checks = await outcome(verifier, t, None, sid)
        assert reward == 0.0 and "leaves the workspace" in checks[0].detail


async def test_file_checks_fail_fast_on_a_1_gb_file(sandbox, verifier):
    # sparse: costs no memory or disk; larger than max_file_bytes (1 MiB here) -> fails, never read
    limits = {"file_size_bytes": 2 << 30}
    async with episode(
        sandbox, commands=("truncate -s 1G big.bin && ls -l big.bin",), limits=limits
    ) as sid:
        start = time.perf_counter()
        for check in (
            {"type": "file_contains", "path": "big.bin", "substring": "x"},
            {"type": "file_sha256", "path": "big.bin", "sha256": "0" * 64},
        ):
            reward, checks = await outcome(verifier, task(check), None, sid)
            assert reward == 0.0 and "larger than" in checks[0].detail
        assert time.perf_counter() - start < 10  # bound, not a benchmark: without the fix it hangs


# --- file_sha256 -------------------------------------------------------------------------------


async def test_file_sha256_compares_the_exact_bytes(sandbox, verifier):
    import hashlib

    good = hashlib.sha256(b"hello\n").hexdigest()
    async with episode(sandbox, commands=("echo hello > h.txt", "printf hello > n.txt")) as sid:
        assert (
            await outcome(
                verifier, task({"type": "file_sha256", "path": "h.txt", "sha256": good}), None, sid
            )
        )[0] == 1.0
        assert (
            await outcome(
                verifier, task({"type": "file_sha256", "path": "n.txt", "sha256": good}), None, sid
            )
        )[0] == 0.0


async def test_file_sha256_of_a_fifo_fails_without_hanging(sandbox, verifier):
    t = task({"type": "file_sha256", "path": "pipe", "sha256": "0" * 64})
    async with episode(sandbox, commands=("mkfifo pipe",)) as sid:
        start = time.perf_counter()
        assert (await outcome(verifier, t, None, sid))[0] == 0.0
        assert time.perf_counter() - start < 10  # bound, not a benchmark: without the fix it hangs


# --- command_output_equals ---------------------------------------------------------------------


async def test_command_output_equals_expected_and_reference_command(sandbox, verifier):
    setup = "printf 'b\\na\\nc\\n' > in.txt"
    expected = task(
        {"type": "command_output_equals", "command": "cat out.txt", "expected": "a\nb\nc"},
        setup=setup,
    )
    reference = task(
        {
            "type": "command_output_equals",
            "command": "cat out.txt",
            "reference_command": "sort in.txt",
        },
        setup=setup,
    )
    async with episode(sandbox, setup, ("sort in.txt > out.txt",)) as sid:
        assert (await outcome(verifier, expected, None, sid))[0] == 1.0
        assert (await outcome(verifier, reference, None, sid))[0] == 1.0
    async with episode(sandbox, setup, ("cp in.txt out.txt",)) as sid:
        assert (await outcome(verifier, expected, None, sid))[0] == 0.0
        assert (await outcome(verifier, reference, None, sid))[0] == 0.0


async def test_reference_command_sees_the_post_setup_state_not_the_agents(sandbox, verifier):
    # the agent rewrites in.txt; the reference must still be computed from the original
    t = task(
        {
            "type": "command_output_equals",
            "command": "cat in.txt",
            "reference_command": "cat in.txt",
        },
        setup="echo original > in.txt",
    )
    async with episode(sandbox, "echo original > in.txt", ("echo forged > in.txt",)) as sid:
        assert (await outcome(verifier, t, None, sid))[0] == 0.0


async def test_a_hanging_check_command_fails_within_its_own_timeout(sandbox, verifier):
    t = task(
        {
            "type": "command_output_equals",
            "command": "sleep 100; echo ok",
            "expected": "ok",
            "timeout_s": 1,
        }
    )
    async with episode(sandbox) as sid:
        start = time.perf_counter()
        reward, checks = await outcome(verifier, t, None, sid)
        assert reward == 0.0 and "ran past 1 s" in checks[0].detail
        assert time.perf_counter() - start < 10  # bound, not a benchmark: without the fix it hangs


async def test_check_commands_ignore_the_agents_cwd_path_and_exported_variables(sandbox, verifier):
    t = task({"type": "command_output_equals", "command": "cat numbers.txt", "expected": "1\n2"})
    hijack = (
        "printf '1\\n2\\n' > /tmp/real",
        "mkdir -p bin sub && printf '#!/bin/sh\\necho 1; echo 2\\n' > bin/cat && chmod +x bin/cat",
        "export PATH=$PWD/bin:$PATH LC_ALL=tr_TR.UTF-8 && cd sub",
    )
    async with episode(sandbox, commands=hijack) as sid:
        # the fake `cat` on the agent's PATH would print the expected text; numbers.txt does not exist
        reward, checks = await outcome(verifier, t, None, sid)
        assert reward == 0.0, checks
    async with episode(sandbox, commands=("seq 1 2 > numbers.txt", "mkdir sub && cd sub")) as sid:
        assert (await outcome(verifier, t, None, sid))[0] == 1.0  # runs at the root, not in sub/


async def test_a_forged_shell_state_file_cannot_fake_a_command_check(sandbox, verifier):
    t = task({"type": "command_output_equals", "command": "cat numbers.txt", "expected": "1\n2"})
    forge = "trap - EXIT; printf 'exec() { echo 1; echo 2; }\\ncat() { echo 1; echo 2; }\\n' > /run/shellrl/state/env"
    async with episode(sandbox, commands=(forge,)) as sid:
        assert (await outcome(verifier, t, None, sid))[0] == 0.0  # numbers.txt does not exist
        assert (
            await sandbox.exec(sid, "cat numbers.txt")
        ).stdout == "1\n2\n"  # the forgery is in place


async def test_the_agents_background_processes_are_dead_before_the_checks_run(sandbox, verifier):
    # a leftover process could rewrite files between checks or tamper with a check command
    t = task(
        {"type": "file_exists", "path": "out.txt"},
        {"type": "command_output_equals", "command": "sleep 0.5; cat out.txt", "expected": "done"},
    )
    flipper = (
        "setsid sh -c 'echo done > out.txt; sleep 0.3; echo changed > out.txt; sleep 300' >/dev/null 2>&1 &"
        " until [ -s out.txt ]; do sleep 0.01; done"
    )
    async with episode(sandbox, commands=(flipper,)) as sid:
        reward, checks = await outcome(verifier, t, None, sid)
        assert reward == 1.0, checks  # without the kill the second check reads "changed"
        left = await sandbox.exec(sid, "ps -e -o comm= | grep -c sleep")
        assert left.stdout == "0\n"


async def test_task_env_applies_to_check_commands(sandbox, verifier):
    t = task(
        {"type": "command_output_equals", "command": "cat ~/x.txt", "expected": "home"},
        env={"HOME": "<workspace>"},
        setup="echo home > ~/x.txt",
    )
    async with episode(sandbox, "echo home > ~/x.txt", env={"HOME": "<workspace>"}) as sid:
        assert (await outcome(verifier, t, None, sid))[0] == 1.0


# --- command_exit_code -------------------------------------------------------------------------


async def test_command_exit_code_pass_fail_and_a_background_process_holding_stdout(
    sandbox, verifier
):
    async with episode(
        sandbox, commands=("chmod 755 . && touch run.sh && chmod +x run.sh",)
    ) as sid:
        assert (
            await outcome(
                verifier,
                task({"type": "command_exit_code", "command": "test -x run.sh"}),
                None,
                sid,
            )
        )[0] == 1.0
        assert (
            await outcome(
                verifier,
                task({"type": "command_exit_code", "command": "test -d run.sh"}),
                None,
                sid,
            )
        )[0] == 0.0
        t = task(
            {
                "type": "command_exit_code",
                "command": "sleep 300 & exit 3",
                "exit_code": 3,
                "timeout_s": 3,
            }
        )
        start = time.perf_counter()
        assert (await outcome(verifier, t, None, sid))[0] == 1.0
        assert time.perf_counter() - start < 10  # bound, not a benchmark: without the fix it hangs


async def test_command_output_flood_is_a_failure_not_a_crash(sandbox, verifier):
    t = task(
        {
            "type": "command_output_equals",
            "command": "yes | head -c 5000000",
            "expected": "y",
            "timeout_s": 5,
        }
    )
    async with episode(sandbox) as sid:
        reward, checks = await outcome(verifier, t, None, sid)
        assert reward == 0.0 and "cut by the sandbox" in checks[0].detail


# --- answer checks through the same path ---------------------------------------------------------


async def test_answer_checks_pass_fail_and_hostile_answers(sandbox, verifier):
    equals = task({"type": "answer_equals", "expected": "linux"})
    integer = task({"type": "answer_integer_equals", "expected": 5})
    matches = task({"type": "answer_matches", "pattern": "(a|aa)+", "timeout_s": 0.5})
    assert (await outcome(verifier, equals, "linux\n", None))[0] == 1.0
    assert (await outcome(verifier, equals, "Linux", None))[0] == 0.0
    assert (await outcome(verifier, equals, "linux\x00" + "x" * 100_000, None))[0] == 0.0
    assert (await outcome(verifier, integer, " 5 ", None))[0] == 1.0
    assert (await outcome(verifier, integer, "5; rm -rf /", None))[0] == 0.0
    assert (await outcome(verifier, integer, "9" * 50_000, None))[0] == 0.0
    assert (await outcome(verifier, matches, "aaaa", None))[0] == 1.0
    start = time.perf_counter()
    assert (await outcome(verifier, matches, "a" * 40 + "!", None))[0] == 0.0
    assert time.perf_counter() - start < 10  # bound, not a benchmark: without the fix it hangs


# --- INFRA: never a 0 ----------------------------------------------------------------------------


async def test_a_released_session_is_an_infra_failure_not_a_zero(sandbox, verifier):
    session = await sandbox.create_session()
    await sandbox.delete(session["session_id"])
    result = await verifier.verify(
        task({"type": "file_exists", "path": "a"}), None, session["session_id"]
    )
    assert result.failure == Failure.FAILURE_INFRA_VERIFIER and result.reward is None
    assert result.to_json()["reward"] is None and result.to_json()["failure"] == "infra_verifier"


async def test_an_unreachable_sandbox_is_an_infra_failure(sandbox_url):
    async with SandboxClient(f"http://127.0.0.1:{free_port()}", timeout_s=2) as dead:
        verifier = build_verifier(VerifierSettings(worker_enabled=False), dead)
        result = await verifier.verify(
            task({"type": "command_exit_code", "command": "true"}), None, "abc"
        )
        assert result.failure == Failure.FAILURE_INFRA_VERIFIER and not result.scored


async def test_a_reference_command_whose_setup_fails_is_an_infra_failure(sandbox, verifier):
    t = task(
        {"type": "command_output_equals", "command": "true", "reference_command": "true"},
        setup="exit 3",
    )
    async with episode(sandbox) as sid:
        result = await verifier.verify(t, None, sid)
    assert result.failure == Failure.FAILURE_INFRA_VERIFIER and "setup" in result.failure_detail


async def test_a_crashing_verification_never_touches_the_other_members_of_its_group(sandbox_url):
    import asyncio

    from tests.fakes.faulty_sandbox_client import FaultySandboxClient

    seed = next(t for t in seed_tasks() if t.task_id == "seed-numbers")
    async with SandboxClient(sandbox_url) as real:
        sids = [(await real.create_session())["session_id"] for _ in range(4)]
        for sid in sids[:2]:
            await real.exec(sid, seed.reference_solution)
        async with FaultySandboxClient(sandbox_url, broken={sids[1]}) as faulty:
            verifier = build_verifier(
                VerifierSettings(sandbox_url=sandbox_url, worker_enabled=False), faulty
            )
            results = await asyncio.gather(*(verifier.verify(seed, "5", sid) for sid in sids))
        for sid in sids:
            await real.delete(sid)
    rewards = [r.reward.reward if r.scored else None for r in results]
    assert rewards == [
        1.0,
        None,
        0.0,
        0.0,
    ]  # member 1 crashed (malformed sandbox answer) -> INFRA only
    assert (
        results[1].failure == Failure.FAILURE_INFRA_VERIFIER
        and "verifier error" in results[1].failure_detail
    )
    assert all(r.failure == Failure.FAILURE_NONE for i, r in enumerate(results) if i != 1)


async def test_safety_events_of_the_session_set_the_safety_component(sandbox, verifier):
    t = task({"type": "file_exists", "path": "a"})
    async with episode(sandbox, commands=("touch a b && rm -f b",)) as sid:
        result = await verifier.verify(t, None, sid)
    assert result.reward.reward == 1.0 and result.reward.components["safety_penalty"] == -1.0
    assert result.reward.training_reward == 1.0  # shaping is off by default
    assert result.safety_events == ("rm_recursive_or_force",)


# --- the four seed tasks -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", seed_tasks(), ids=lambda t: t.task_id)
async def test_seed_reference_solution_passes_and_typical_wrong_answer_fails(
    sandbox, verifier, seed
):
    async with episode(sandbox, seed.setup) as sid:
        ran = await sandbox.exec(sid, seed.reference_solution, timeout_s=10)
        assert (await outcome(verifier, seed, ran.stdout, sid))[0] == 1.0
    async with episode(sandbox, seed.setup) as sid:
        assert (await outcome(verifier, seed, WRONG_ANSWERS[seed.task_id], sid))[0] == 0.0


async def test_sha256_seed_means_the_string_without_a_trailing_newline(sandbox, verifier):
    seed = next(t for t in seed_tasks() if t.task_id == "seed-sha256")
    async with episode(sandbox) as sid:
        with_newline = (
            await sandbox.exec(sid, "echo nano_miles_rl | sha256sum | cut -d' ' -f1")
        ).stdout
        without = (
            await sandbox.exec(sid, "printf %s nano_miles_rl | sha256sum | cut -d' ' -f1")
        ).stdout
        assert with_newline.strip() == SHA256_WITH_NEWLINE
        assert (await outcome(verifier, seed, with_newline, sid))[0] == 0.0
        assert (await outcome(verifier, seed, without.upper(), sid))[
            0
        ] == 1.0  # hex case is ignored


async def test_numbers_seed_needs_the_file_not_only_the_answer(sandbox, verifier):
    seed = next(t for t in seed_tasks() if t.task_id == "seed-numbers")
    async with episode(sandbox) as sid:  # right answer, no file
        assert (await outcome(verifier, seed, "5", sid))[0] == 0.0
    async with episode(
        sandbox, commands=("seq 0 4 > numbers.txt",)
    ) as sid:  # 5 lines, wrong content
        assert (await outcome(verifier, seed, "5", sid))[0] == 0.0
