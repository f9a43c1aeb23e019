"""ServiceSettings: SHELLRL_ environment, typos fail naming the field."""

from __future__ import annotations

import pytest
from pydantic import Field, ValidationError

from shellrl.service.settings import ServiceSettings, unknown_env_settings


class DemoSettings(ServiceSettings):
    engine_urls: str = Field("http://127.0.0.1:30000", description="Engines to call.")
    max_turns: int = Field(8, ge=1)


def test_environment_with_the_prefix_sets_fields(monkeypatch):
    monkeypatch.setenv("SHELLRL_REDIS_URL", "redis://127.0.0.1:7000/0")
    monkeypatch.setenv("SHELLRL_MAX_TURNS", "3")
    settings = DemoSettings()
    assert settings.redis_url == "redis://127.0.0.1:7000/0" and settings.max_turns == 3


def test_mistyped_constructor_argument_fails_naming_the_field():
    with pytest.raises(ValidationError) as info:
        DemoSettings(max_turn=3)
    assert "max_turn" in str(info.value) and "Extra inputs are not permitted" in str(info.value)


def test_mistyped_environment_variable_fails_naming_it_and_the_likely_field(monkeypatch):
    monkeypatch.setenv("SHELLRL_REDIS_ULR", "redis://127.0.0.1:7000/0")
    with pytest.raises(ValidationError) as info:
        DemoSettings()
    assert "SHELLRL_REDIS_ULR" in str(info.value) and "SHELLRL_REDIS_URL" in str(info.value)


def test_another_services_settings_in_a_shared_environment_pass(monkeypatch):
    monkeypatch.setenv("SHELLRL_SANDBOX_ROOT", "/tmp/x")  # a field of some other service
    assert DemoSettings().engine_urls == "http://127.0.0.1:30000"
    assert unknown_env_settings(DemoSettings)["sandbox_root"] is None
    # a singular twin of engine_urls that no service has is a typo
    monkeypatch.setenv("SHELLRL_ENGINE_URL", "http://e")
    with pytest.raises(ValidationError, match="did you mean SHELLRL_ENGINE_URLS"):
        DemoSettings()


def test_values_are_validated_with_their_bounds(monkeypatch):
    monkeypatch.setenv("SHELLRL_PORT", "70000")
    with pytest.raises(ValidationError) as info:
        DemoSettings()
    assert "port" in str(info.value)


def test_settings_are_frozen_and_public_dict_is_json():
    settings = DemoSettings(port=8100)
    with pytest.raises(ValidationError):
        settings.port = 1
    assert settings.public_dict()["port"] == 8100


def test_one_typo_means_one_edit_or_one_swap():
    from shellrl.service.settings import one_typo_away

    fields = {"redis_url", "exec_timeout_s", "engine_urls", "port"}
    assert one_typo_away("redis_ulr", fields) == "redis_url"  # swap
    assert one_typo_away("redis_ur", fields) == "redis_url"  # deletion
    assert one_typo_away("exec_timeout_ms", fields) == "exec_timeout_s"  # insertion
    assert one_typo_away("check_timeout_s", fields) is None  # another service's setting
    assert one_typo_away("engine_url", fields) is None  # singular/plural twin
    assert one_typo_away("pork", fields) == "port"  # substitution
    assert one_typo_away("prt", fields) is None  # names under 4 characters are not judged


def test_no_two_services_settings_are_one_typo_apart():
    """A shared environment carries every service's settings; none may look like a typo of another's."""
    import importlib

    from shellrl.service.settings import one_typo_away

    fields: dict[str, set[str]] = {}
    for svc in ("rollout", "sandbox", "verifier", "learner", "engine"):
        try:
            module = importlib.import_module(f"services.{svc}.settings")
        except ModuleNotFoundError:
            continue
        for obj in vars(module).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, ServiceSettings)
                and obj is not ServiceSettings
            ):
                fields[f"{svc}.{obj.__name__}"] = set(obj.model_fields)
    clashes = [
        (cls, other, one_typo_away(other, own))
        for cls, own in fields.items()
        for others in fields.values()
        for other in others - own
        if one_typo_away(other, own)
    ]
    assert not clashes, (
        f"rename one of each pair (class, foreign setting, own setting): {sorted(set(clashes))}"
    )


def test_public_dict_never_shows_a_url_password():
    from shellrl.service.settings import EngineFleetSettings, redact_url

    settings = EngineFleetSettings(
        redis_url="redis://:s3,cret@redis:6379/0", engine_urls="http://a:1,http://u:pw@b:2/x"
    )
    public = settings.public_dict()
    assert public["redis_url"] == "redis://:***@redis:6379/0"  # a comma is legal in a password
    assert public["engine_urls"] == "http://a:1,http://u:***@b:2/x"
    assert "s3,cret" not in str(public) and settings.redis_url == "redis://:s3,cret@redis:6379/0"
    assert redact_url("rediss://user:p@ss@h/0") == "rediss://user:***@h/0"
    assert (
        redact_url("redis://h:6379/0?password=secret&db=1") == "redis://h:6379/0?password=***&db=1"
    )
    assert redact_url("redis://user@h/0") == "redis://user@h/0"
    assert redact_url("plain text @ somewhere") == "plain text @ somewhere"


def test_a_plural_or_singular_twin_that_no_service_has_is_a_typo(monkeypatch):
    from services.engine.settings import EngineSettings

    monkeypatch.setenv("SHELLRL_NUM_THREAD", "1")
    with pytest.raises(
        ValidationError,
        match="SHELLRL_NUM_THREAD: unknown setting; did you mean SHELLRL_NUM_THREADS",
    ):
        EngineSettings()


def test_a_services_own_field_with_its_name_in_front_is_a_typo_but_its_aliases_pass(monkeypatch):
    # BENCHMARKS.md named the warm pool SHELLRL_SANDBOX_WARM_POOL_PER_SETUP: silently ignored
    from services.rollout.settings import RolloutSettings
    from services.sandbox.settings import SandboxSettings

    monkeypatch.setenv("SHELLRL_SANDBOX_ISOLATION", "fallback")  # a real alias of `isolation`
    monkeypatch.setenv("SHELLRL_SANDBOX_URL", "http://s")  # the rollout gateway's setting
    monkeypatch.setenv("SHELLRL_ENGINE_PORT", "30001")  # compose's host port (.env.example)
    assert SandboxSettings().isolation == "fallback"
    monkeypatch.setenv("SHELLRL_SANDBOX_WARM_POOL_PER_SETUP", "2")
    with pytest.raises(
        ValidationError,
        match="SHELLRL_SANDBOX_WARM_POOL_PER_SETUP: unknown setting; did you mean "
        "SHELLRL_WARM_POOL_PER_SETUP",
    ):
        SandboxSettings()
    assert RolloutSettings().sandbox_url == "http://s"  # another service's field: not its business


def test_a_service_started_with_a_bad_setting_exits_with_one_line_naming_it():
    import sys

    from tests.helpers.owned_processes import run_owned
    from tests.helpers.processes import REPO

    env = {"PATH": "/usr/bin:/bin", "SHELLRL_NUM_THREAD": "1", "SHELLRL_PORT": "99999"}
    done = run_owned(
        [sys.executable, "-m", "services.verifier"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout_s=60,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "SHELLRL_PORT: Input should be less than or equal to 65535" in done.stderr
