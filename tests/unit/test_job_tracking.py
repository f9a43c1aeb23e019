"""The main job's tracker tables of evaluations (cli/job_tracking.py, issue 34 item 1): success
with its interval, the per-template table and a table of sampled episodes fetched from the
gateway's GET /v1/trajectories/{id} (a real HTTP server here serving transcripts), read back from
TensorBoard's event files."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from cli.job_tracking import SAMPLE_COLUMNS, eval_samples, log_evaluations
from shellrl.tracking import TrackingConfig, create_tracker, installed
from tests.unit.test_tracking import read_tensorboard, read_texts


def transcript(trajectory_id: str) -> dict:
    return {
        "trajectory_id": trajectory_id,
        "prompt": {"text": "system ... count the lines of /data/x.txt"},
        "turns": [
            {"turn": 0, "segments": [{"text": "<bash>wc -l /data/x.txt</bash>"}, {"text": "3\n"}]},
            {"turn": 1, "segments": [{"text": "<answer>3</answer>"}]},
        ],
        "num_turns": 2,
        "reward": 1.0 if trajectory_id.endswith("ok") else 0.0,
    }


class Gateway(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        path, _, query = self.path.partition("?")
        trajectory_id = path.rsplit("/", 1)[-1]
        assert query == "skip_special_tokens=true", self.path  # texts without template markers
        if "missing" in trajectory_id:
            self.send_response(404)
            self.end_headers()
            return
        body = json.dumps(transcript(trajectory_id)).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with httpx.Client(base_url=f"http://127.0.0.1:{server.server_address[1]}") as client:
        yield client
    server.shutdown()
    server.server_close()


VIEW = {
    "state": "done",
    "episodes_scored": 4,
    "success_rate": 0.5,
    "policy_versions_seen": [3],
    "per_task": {},
    "results": [
        {"task_id": "a", "outcome": "wrong", "trajectory_id": "e-a-0-bad", "reward": 0.0},
        {"task_id": "b", "outcome": "wrong", "trajectory_id": "e-b-0-missing", "reward": 0.0},
        {"task_id": "c", "outcome": "success", "trajectory_id": "e-c-0-ok", "reward": 1.0},
        {"task_id": "d", "outcome": "infra_engine", "reward": None},
    ],
}


def test_samples_take_successes_and_the_rest_in_turn_and_skip_what_cannot_be_shown(gateway):
    rows = eval_samples(gateway, VIEW, rows=3)
    assert [(r[0], r[1], r[2]) for r in rows] == [("c", "success", 1.0), ("a", "wrong", 0.0)]
    values = dict(zip(SAMPLE_COLUMNS, rows[0]))
    assert values["transcript"] == "<bash>wc -l /data/x.txt</bash>3\n<answer>3</answer>"
    assert values["turns"] == 2 and values["prompt"].endswith("/data/x.txt")
    assert eval_samples(None, VIEW) == []


@pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard not installed")
def test_an_evaluation_logs_its_success_templates_and_samples(gateway, tmp_path):
    tracker = create_tracker(TrackingConfig(backend="tensorboard"), "job", tmp_path)
    log_evaluations(tracker, {"eval_id": VIEW}, {}, gateway)
    tracker.close()
    scalars, _ = read_tensorboard(tmp_path / "job")
    assert scalars["eval/eval_id/success_rate"][0][0] == 3  # at the version evaluated
    ((step, table),) = read_texts(tmp_path / "job", "eval/eval_id/samples")
    assert step == 3 and table.splitlines()[0].startswith("| task_id | outcome | reward")
    assert len(table.splitlines()) == 2 + 2  # header, rule, two episodes
