"""Metric naming rules (DESIGN.md section 9) and JSON logs."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from shellrl.service import metrics
from shellrl.service.logging import JsonFormatter, log_context


@pytest.fixture
def registry():
    return CollectorRegistry()


def test_well_named_metrics_are_created_and_exported(registry):
    c = metrics.counter(
        "shellrl_trajectories_total", "Trajectories.", ("outcome",), registry=registry
    )
    g = metrics.gauge("shellrl_policy_version", "Version.", registry=registry)
    h = metrics.histogram("shellrl_sandbox_exec_seconds", "Exec time.", registry=registry)
    c.labels("scored").inc()
    g.set(3)
    h.observe(0.25)
    text = generate_latest(registry).decode()
    assert 'shellrl_trajectories_total{outcome="scored"} 1.0' in text
    assert "shellrl_policy_version 3.0" in text
    assert 'shellrl_sandbox_exec_seconds_bucket{le="0.5"} 1.0' in text


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda r: metrics.counter("trajectories_total", "x", registry=r), "must match"),
        (lambda r: metrics.counter("shellrl_Trajectories_total", "x", registry=r), "must match"),
        (lambda r: metrics.counter("shellrl_trajectories", "x", registry=r), "must end in _total"),
        (lambda r: metrics.gauge("shellrl_queue_total", "x", registry=r), "must not end in _total"),
        (lambda r: metrics.histogram("shellrl_exec_ms", "x", registry=r), "base units"),
        (lambda r: metrics.gauge("shellrl_memory_mb", "x", registry=r), "base units"),
        (lambda r: metrics.gauge("shellrl_gpu_percent", "x", registry=r), "base units"),
        (
            lambda r: metrics.counter("shellrl_x_total", "x", ("trajectory_id",), registry=r),
            "ids are not labels",
        ),
        (lambda r: metrics.counter("shellrl_y_total", "x", ("Outcome",), registry=r), "snake_case"),
    ],
)
def test_badly_named_metrics_are_refused(registry, make, message):
    with pytest.raises(ValueError, match=message):
        make(registry)


def _logger(stream: io.StringIO) -> logging.Logger:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("verifier"))
    logger = logging.getLogger("shellrl.test.json")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def test_log_lines_are_json_with_service_and_structured_ids():
    out = io.StringIO()
    _logger(out).info("scored", extra={"trajectory_id": "t-1", "policy_version": 4})
    line = json.loads(out.getvalue())
    assert line["service"] == "verifier" and line["msg"] == "scored"
    assert line["trajectory_id"] == "t-1" and line["policy_version"] == 4
    assert {"ts", "level", "logger"} <= set(line)


async def test_log_context_tags_lines_of_its_own_task_only():
    out = io.StringIO()
    log = _logger(out)

    async def episode(tid: str) -> None:
        with log_context(trajectory_id=tid, policy_version=2):
            await asyncio.sleep(0.01)
            log.info("step")

    await asyncio.gather(episode("a"), episode("b"))
    log.info("outside")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert sorted(x["trajectory_id"] for x in lines[:2]) == ["a", "b"]
    assert "trajectory_id" not in lines[2]
