"""The main job's issue-20 options reach the services that act on them: `shellrl run --seed N
--dynamic-sampling --pass-rate-steering --eval-samples K --eval-temperature T` parsed by the real
command line, turned into the stack's environment, and read back by the services' own settings."""

from __future__ import annotations

import json
import os

import pytest

from cli.errors import CliError
from cli.job_config import JobConfig
from cli.job_evaluations import evaluation_body
from cli.job_tasks import eval_sets
from cli.main import parse
from services.learner.settings import LearnerSettings
from services.rollout.settings import RolloutSettings


def service_settings(cls, cfg: JobConfig, service: str, monkeypatch):
    stack = cfg.stack_config()
    for name in [n for n in os.environ if n.upper().startswith("SHELLRL_")]:
        monkeypatch.delenv(name)
    for name, value in {**stack.common_env(), **stack.service_env.get(service, {})}.items():
        monkeypatch.setenv(name, value)
    return cls(auth_disabled=True)


def test_the_seed_and_the_training_options_reach_the_gateway_and_the_learner(monkeypatch):
    args = parse(["run", "--seed", "7", "--dynamic-sampling", "--pass-rate-steering"])
    cfg = JobConfig(
        seed=args.seed,
        dynamic_sampling=args.dynamic_sampling,
        pass_rate_steering=args.pass_rate_steering,
    )
    rollout = service_settings(RolloutSettings, cfg, "rollout", monkeypatch)
    learner = service_settings(LearnerSettings, cfg, "learner", monkeypatch)
    assert (rollout.sampling_seed, rollout.pool_seed, learner.seed) == (7, 7, 7)
    assert rollout.dynamic_sampling and learner.dynamic_sampling and rollout.pass_rate_steering
    default = service_settings(RolloutSettings, JobConfig(), "rollout", monkeypatch)
    assert not default.dynamic_sampling and not default.pass_rate_steering


def test_task_sets_follow_the_task_seed_not_the_run_seed():
    ids = lambda cfg: [t.task_id for t in eval_sets(cfg)["eval_id"]]  # noqa: E731
    assert ids(JobConfig(seed=0)) == ids(JobConfig(seed=5)) != ids(JobConfig(task_seed=5))


def test_sampled_evaluations_ask_for_k_episodes_at_the_temperature_and_greedy_for_one():
    assert evaluation_body(["a"], 1, 0.0) == {
        "task_ids": ["a"],
        "greedy": True,
        "episodes_per_task": 1,
    }
    body = evaluation_body(["a", "b"], 4, 0.7)
    assert body["greedy"] is False and body["episodes_per_task"] == 4
    assert body["sampling"] == {"temperature": 0.7}


def test_several_greedy_eval_samples_are_refused_before_anything_starts():
    from cli.commands.run import run

    args = parse(["run", "--eval-samples", "4"])
    with pytest.raises(CliError, match="--eval-temperature > 0"):
        run(args)


def test_the_tracker_reaches_the_learner_and_the_job_logs_its_options(monkeypatch, tmp_path):
    from shellrl.tracking import installed

    args = parse(["run", "--tracker", "none", "--state-dir", str(tmp_path)])
    cfg = JobConfig(tracker=args.tracker, state_dir=tmp_path)
    learner = service_settings(LearnerSettings, cfg, "learner", monkeypatch)
    assert learner.tracker == "none"
    assert learner.tracking_config().directory == str(tmp_path.resolve() / "tracking")
    if not installed("tensorboard"):
        pytest.skip("tensorboard not installed")
    from cli.job_tracking import open_tracker

    cfg = JobConfig(
        tracker="tensorboard", state_dir=tmp_path, extra_env={"SHELLRL_API_TOKEN": "secret"}
    )
    open_tracker(cfg).close()
    logged = json.loads((tmp_path / "tracking" / "job" / "config.json").read_text())
    assert logged["tracker"] == "tensorboard" and logged["kl_coef"] == cfg.kl_coef
    assert logged["extra_env"] == {"SHELLRL_API_TOKEN": "***"}
    assert (tmp_path / "tracking" / "run_name").exists()  # the learner's run name too


def test_the_job_logs_every_services_resolved_config(tmp_path):
    """What each service serves at GET /v1/config goes to the job's tracker under
    config/<service>; a service that does not answer is left out (a real HTTP server here)."""
    pytest.importorskip("tensorboard")
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from cli.job_tracking import log_service_configs
    from shellrl.tracking import TrackingConfig, create_tracker

    class Config(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"require_command": True, "path": self.path}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Config)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        tracker = create_tracker(TrackingConfig(backend="tensorboard"), "job", tmp_path)
        url = f"http://127.0.0.1:{server.server_address[1]}"
        log_service_configs(tracker, {"verifier": url, "rollout": "http://127.0.0.1:9"}, {})
        tracker.close()
    finally:
        server.shutdown()
        server.server_close()
    logged = json.loads((tmp_path / "job" / "config" / "verifier.json").read_text())
    assert logged == {"require_command": True, "path": "/v1/config"}
    assert not (tmp_path / "job" / "config" / "rollout.json").exists()
