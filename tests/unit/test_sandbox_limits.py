"""What the sandbox cannot run, the task contract refuses at submission (issue 17): the env size
limit stated once (`shellrl.contract.tasks.MAX_ENV_BYTES`), NUL bytes and lone surrogates."""

from __future__ import annotations

import pytest

from services.sandbox.sessions import session_input
from shellrl.contract import TaskValidationError, task_from_json
from shellrl.contract.tasks import LIMITS, MAX_ENV_BYTES, env_bytes

CHECK = {"type": "answer_equals", "expected": "4"}


def task(**fields) -> dict:
    return {"instruction": "add 2 and 2", "check": CHECK, **fields}


def test_the_sandbox_and_the_contract_share_one_env_limit():
    assert session_input.MAX_ENV_BYTES is MAX_ENV_BYTES and LIMITS["env_bytes"] == MAX_ENV_BYTES
    # any contract-valid entry fits execve(2)
    assert MAX_ENV_BYTES < session_input.EXECVE_STRING_BYTES


def test_an_env_at_the_limit_is_accepted_and_one_byte_more_is_refused():
    at_limit = {"BIG": "x" * (MAX_ENV_BYTES - len("BIG=") - 1)}
    assert env_bytes(at_limit) == MAX_ENV_BYTES
    assert task_from_json(task(env=at_limit)).env["BIG"] == at_limit["BIG"]
    with pytest.raises(TaskValidationError) as info:
        task_from_json(task(env={"BIG": at_limit["BIG"] + "x"}))
    assert info.value.field == "env"


@pytest.mark.parametrize(
    "env", [{"BIG": "x" * 200_000}, {f"KEY_{i}": "v" * 30 for i in range(3000)}]
)
def test_a_large_env_value_or_many_keys_is_refused_naming_env(env):
    with pytest.raises(TaskValidationError) as info:
        task_from_json(task(env=env))
    assert info.value.field == "env" and str(MAX_ENV_BYTES) in info.value.message


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"setup": "echo \ud800"}, "setup"),
        ({"instruction": "add \udcff"}, "instruction"),
        ({"env": {"K": "v\ud800"}}, "env.K"),
        ({"env": {"K": "v\x00"}}, "env.K"),
        ({"env": {"K\ud800": "v"}}, "env.K\\ud800"),
    ],
)
def test_nul_bytes_and_lone_surrogates_are_refused_naming_the_field(fields, field):
    with pytest.raises(TaskValidationError) as info:
        task_from_json(task(**fields))
    assert info.value.field == field
    info.value.field.encode("utf-8")  # the error itself can be sent as JSON
