"""The learner's choices around a push (issue 30): which pause a push takes, when `in_place` is
refused, and the admin key's settings."""

from __future__ import annotations

import pytest

from services.learner.settings import LearnerSettings
from services.learner.weights.push_setup import pause_for, radix_cache_refusal

KEY = "admin-key-for-weights-0123456789"


def test_auto_retracts_sglang_beyond_one_bucket_and_pauses_shellrls_engine_in_place():
    assert pause_for("auto", 1) == "off"
    assert pause_for("auto", 2) == "retract"
    # shellrl's engine would otherwise commit only once its running batch drained
    assert pause_for("auto", 1, commits_atomically=True) == "in_place"
    assert pause_for("auto", 2, commits_atomically=True) == "in_place"
    assert [pause_for(m, 5) for m in ("off", "retract", "in_place")] == [
        "off",
        "retract",
        "in_place",
    ]


def test_in_place_is_refused_only_for_sglang_engines_with_their_radix_cache_on():
    sglang = {"version": "0.5.23"}
    ours = {"version": "shellrl-engine-0.1.0", "disable_radix_cache": False}
    assert radix_cache_refusal({"u": {**sglang, "disable_radix_cache": True}}) is None
    assert radix_cache_refusal({"u": ours}) is None
    refusal = radix_cache_refusal({"http://a:30000": sglang, "http://b:30000": ours})
    assert refusal.startswith("SHELLRL_WEIGHT_SYNC_PAUSE=in_place") and "http://a:30000" in refusal
    assert "http://b:30000" not in refusal and "--disable-radix-cache" in refusal


def test_the_admin_key_comes_from_one_source_and_must_be_a_token(tmp_path, monkeypatch):
    monkeypatch.setenv("SHELLRL_AUTH_DISABLED", "true")
    assert LearnerSettings().engine_admin_api_key_value() is None
    assert LearnerSettings(engine_admin_api_key=KEY).engine_admin_api_key_value() == KEY
    path = tmp_path / "admin_key"
    path.write_text(f"  {KEY}\n")
    assert LearnerSettings(engine_admin_api_key_file=path).engine_admin_api_key_value() == KEY
    with pytest.raises(ValueError, match="give one of them"):
        LearnerSettings(engine_admin_api_key=KEY, engine_admin_api_key_file=path)
    with pytest.raises(ValueError, match="engine_admin_api_key"):
        LearnerSettings(engine_admin_api_key="short")
    missing = LearnerSettings(engine_admin_api_key_file=tmp_path / "absent")
    with pytest.raises(ValueError, match="engine_admin_api_key_file"):
        missing.engine_admin_api_key_value()


def test_a_tensor_larger_than_the_bucket_budget_goes_alone_and_the_log_says_so(caplog):
    import torch

    from services.learner.weights.weight_transport import split_buckets

    named = [
        ("a", torch.zeros(10)),
        ("lm_head.only_in_this_test", torch.zeros(1000)),
        ("b", torch.zeros(10)),
    ]
    with caplog.at_level("WARNING", logger="services.learner.weights.weight_transport"):
        buckets = split_buckets(named, bucket_bytes=1024)
    assert [[n for n, _ in b] for b in buckets] == [["a"], ["lm_head.only_in_this_test"], ["b"]]
    said = [r for r in caplog.records if getattr(r, "tensor", None) == "lm_head.only_in_this_test"]
    assert len(said) == 1 and said[0].bytes == 4000 and said[0].bucket_bytes == 1024


def test_the_disk_transports_safetensors_are_readable_by_an_engine_of_another_user(tmp_path):
    import torch

    from services.learner.weights.weight_transport import WeightStaging

    staging = WeightStaging("disk", tmp_path)
    model = torch.nn.Linear(4, 2)
    whole = staging.prepare(model, 1)["model_path"]
    files = list((tmp_path / "v00000001").glob("*.safetensors"))
    assert files and whole.endswith("v00000001")
    assert {f.stat().st_mode & 0o777 for f in files} == {0o644}  # safetensors writes 0600
