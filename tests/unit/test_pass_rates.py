"""cli.pass_rates: per-template rates from an evaluation view, the curriculum band, and the
probability that a GRPO group has reward variance."""

import json
from pathlib import Path

import pytest

from cli import pass_rates as pr


def test_rates_from_view_counts_successes_per_template_and_skips_unscored_episodes():
    view = {
        "results": [
            {"task_id": "a1", "outcome": "success", "reward": 1.0},
            {"task_id": "a1", "outcome": "wrong", "reward": 0.0},
            {"task_id": "a2", "outcome": "infra", "reward": None},  # INFRA: not a task failure
            {"task_id": "b1", "outcome": "wrong", "reward": 0.0},
        ]
    }
    rates = pr.rates_from_view(view, {"a1": "alpha", "a2": "alpha", "b1": "beta"})
    assert [(r.template, r.successes, r.episodes) for r in rates] == [
        ("alpha", 1, 2),
        ("beta", 0, 1),
    ]
    assert rates[0].rate == 0.5 and rates[1].rate == 0.0


@pytest.mark.parametrize(
    "p, expected", [(0.0, 0.0), (1.0, 0.0), (0.5, 1 - 2 * 0.5**8), (0.1, 1 - 0.1**8 - 0.9**8)]
)
def test_trainable_group_probability(p, expected):
    rate = pr.TemplateRate("t", round(p * 1000), 1000)
    assert rate.trainable_group_probability(8) == pytest.approx(expected)


def test_select_templates_keeps_the_band_inclusive():
    rates = [
        pr.TemplateRate("never", 0, 12),
        pr.TemplateRate("low", 1, 20),
        pr.TemplateRate("mid", 3, 12),
        pr.TemplateRate("edge", 3, 4),
        pr.TemplateRate("always", 12, 12),
    ]
    assert pr.select_templates(rates, 0.05, 0.75) == ["low", "mid", "edge"]


def test_write_then_load_round_trips(tmp_path: Path):
    rates = [pr.TemplateRate("a", 1, 12), pr.TemplateRate("b", 0, 12)]
    pr.write(tmp_path / "r.json", rates, {"temperature": 0.7})
    assert pr.load(tmp_path / "r.json") == rates
    assert json.loads((tmp_path / "r.json").read_text())["temperature"] == 0.7


def test_the_committed_measurements_load():
    for name in ("pass_rates_T1.0.json", "pass_rates_T0.7.json"):
        rates = pr.load(Path(__file__).resolve().parents[2] / "docs" / "runs" / "pass-rates" / name)
        assert rates and all(0 <= r.successes <= r.episodes for r in rates)


class _StuckEvaluationGateway:
    """A fault-injecting fake of the rollout gateway's task and evaluation routes (real HTTP on
    loopback): tasks are accepted, the evaluation is created, then stays `running` with 3
    episodes done until `finish_after` polls (None: never)."""

    def __init__(self, finish_after: int | None) -> None:
        import http.server
        import threading

        fake = self
        self.polls = 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                sent = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if self.path == "/v1/tasks":
                    self._answer({"tasks": [{"task_id": t["task_id"]} for t in sent]})
                else:
                    self._answer({"evaluation_id": "e1"})

            def do_GET(self) -> None:
                fake.polls += 1
                done = finish_after is not None and fake.polls > finish_after
                self._answer({"state": "done" if done else "running", "episodes_done": 3})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def _one_template() -> str:
    from tasksets import load_taskset

    return load_taskset("generated", "train", seed=0)[0].template


def test_measure_gives_up_at_its_deadline_naming_the_evaluation_and_its_progress():
    """New user, issue 34 item 7: the pass-rate wait polled with no overall deadline."""
    import time

    with _StuckEvaluationGateway(finish_after=None) as gateway:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"evaluation e1 not ended after 1 s: state "
                           r"'running', 3/2 episodes .*GET /v1/evaluations/e1"):  # fmt: skip
            pr.measure(gateway.url, tasks_per_template=1, episodes_per_task=2, temperature=1.0,
                       max_new_tokens=8, templates=(_one_template(),), poll_s=0.05,
                       headers={}, timeout_s=1.0)  # fmt: skip
        assert time.monotonic() - start < 30 and gateway.polls >= 2


def test_measure_returns_the_view_once_the_evaluation_ended():
    with _StuckEvaluationGateway(finish_after=2) as gateway:
        rates, view = pr.measure(gateway.url, tasks_per_template=1, episodes_per_task=2,
                                 temperature=1.0, max_new_tokens=8,
                                 templates=(_one_template(),), poll_s=0.05, headers={},
                                 timeout_s=60.0)  # fmt: skip
    assert view["state"] == "done" and gateway.polls == 3 and rates == []
