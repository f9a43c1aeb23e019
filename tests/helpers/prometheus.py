"""A real Prometheus for tests, and the PromQL of the generated Grafana dashboards.

`PrometheusServer(directory, targets)` starts Debian's `prometheus` binary on a free loopback port
with a generated config (cli.prometheus_scrape) that scrapes `targets` every second and keeps
its TSDB in `directory`; `stop()` ends it by pid. `panel_queries()` walks the dashboard JSON that
Grafana provisions (deploy/grafana/dashboards/*.json) and `evaluate()` runs every query through
Prometheus' HTTP API (/api/v1/query), with Grafana's macros replaced by fixed values.

    with PrometheusServer(tmp_path / "prom", {"sandbox": [f"127.0.0.1:{port}"]}) as prom:
        prom.wait_for_scrapes(2)
        scraped = metric_families(prom.scraped_metrics())
        for result in evaluate(prom, [q for q in panel_queries() if q.metrics <= scraped]):
            assert result.has_data, f"{result.query}: {result.error or 'empty result'}"

Install: `apt-get install prometheus` (the Makefile's system-deps does it when the binary is missing).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from cli.prometheus_scrape import render
from tests.helpers.owned_processes import popen_owned, stop_owned
from tests.helpers.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = REPO / "deploy" / "grafana" / "dashboards"
# Grafana's macros, with values that suit a 1 s scrape interval and a short test.
MACROS = {"$__rate_interval": "15s", "$__interval": "1s", "$__range": "5m"}
_METRIC = re.compile(r"\b(shellrl_[a-z0-9_]+|sglang:[a-z0-9_:]+)")
_HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")


@dataclass(frozen=True)
class PanelQuery:
    """One target of one panel: `expr` as written in the dashboard; `promql` with macros replaced."""

    dashboard: str
    panel: str
    ref_id: str
    expr: str

    @property
    def promql(self) -> str:
        return substitute_macros(self.expr)

    @property
    def metrics(self) -> frozenset[str]:
        """Metric families the query reads (histogram suffixes stripped)."""
        return metric_families(_METRIC.findall(self.expr))

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel} [{self.ref_id}]: {self.expr}"


@dataclass(frozen=True)
class QueryResult:
    query: PanelQuery
    status: str  # "success" or "error"
    error: str
    result: list

    @property
    def has_data(self) -> bool:
        return self.status == "success" and len(self.result) > 0


def substitute_macros(expr: str, macros: Mapping[str, str] = MACROS) -> str:
    for name in sorted(macros, key=len, reverse=True):  # $__rate_interval before $__range
        expr = expr.replace(name, macros[name])
    if "$" in expr:
        raise ValueError(f"unknown Grafana variable left in {expr!r}")
    return expr


def _walk_panels(panels: Iterable[dict]) -> Iterable[dict]:
    for panel in panels:
        yield panel
        yield from _walk_panels(panel.get("panels", ()))  # panels nested in collapsed rows


def panel_queries(dashboard_dir: Path = DASHBOARD_DIR) -> list[PanelQuery]:
    """Every Prometheus target of every panel of every dashboard JSON in `dashboard_dir`."""
    queries = []
    for path in sorted(Path(dashboard_dir).glob("*.json")):
        board = json.loads(path.read_text())
        for panel in _walk_panels(board.get("panels", ())):
            for target in panel.get("targets", ()):
                if target.get("expr"):
                    queries.append(
                        PanelQuery(
                            board["title"], panel["title"], target.get("refId", ""), target["expr"]
                        )
                    )
    return queries


def metric_families(names: Iterable[str]) -> frozenset[str]:
    """Series names with the histogram suffixes (_bucket, _sum, _count) stripped."""
    return frozenset(_HISTOGRAM_SUFFIX.sub("", name) for name in names)


class PrometheusServer:
    """Debian's `prometheus` on 127.0.0.1:<free port>, scraping `targets` ({job: ["host:port", ...]})."""

    def __init__(
        self,
        directory: Path,
        targets: Mapping[str, str | Sequence[str]],
        scrape_interval_s: float = 1.0,
        port: int | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.targets = dict(targets)
        self.scrape_interval_s = scrape_interval_s
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.directory / "prometheus.log"

    def start(self, timeout_s: float = 30.0) -> PrometheusServer:
        exe = shutil.which("prometheus")
        if exe is None:
            raise RuntimeError("prometheus not on PATH (apt-get install prometheus)")
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "prometheus.yml"
        config.write_text(render(self.targets, self.scrape_interval_s))
        self._log = open(self.log_path, "ab")
        self.proc = popen_owned(
            [
                exe,
                f"--config.file={config}",
                f"--storage.tsdb.path={self.directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout_s}s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def active_targets(self) -> list[dict]:
        response = httpx.get(f"{self.url}/api/v1/targets", params={"state": "active"}, timeout=5.0)
        response.raise_for_status()
        return response.json()["data"]["activeTargets"]

    def scrapes_done(self) -> int:
        """Successful scrapes of the least-scraped target so far (0 before the first)."""
        counts = self.query("sum_over_time(up[1h])")
        expected = sum(1 if isinstance(v, str) else len(v) for v in self.targets.values())
        if len(counts) < expected:
            return 0
        return int(min(float(c["value"][1]) for c in counts))

    def wait_for_scrapes(self, count: int = 2, timeout_s: float = 30.0) -> None:
        """Waits until every target was scraped successfully `count` times in all (`up` == 1 samples).

        Raises TimeoutError naming the targets that are down or unscraped, with their last error.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.scrapes_done() >= count:
                return
            if time.monotonic() > deadline:
                states = [
                    (t["labels"].get("job"), t["scrapeUrl"], t["health"], t["lastError"])
                    for t in self.active_targets()
                ]
                raise TimeoutError(f"targets not scraped {count} times in {timeout_s}s: {states}")
            time.sleep(self.scrape_interval_s / 2)

    def query_raw(self, promql: str) -> dict:
        """GET /api/v1/query; returns the JSON body (status success or error, never raises on 400)."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": promql}, timeout=10.0)
        if response.status_code not in (200, 400, 422):
            response.raise_for_status()
        return response.json()

    def query(self, promql: str) -> list:
        """The result vector of an instant query. Raises ValueError with Prometheus' error."""
        body = self.query_raw(promql)
        if body.get("status") != "success":
            raise ValueError(f"{promql}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]["result"]

    def scraped_metrics(self) -> set[str]:
        """Metric names Prometheus holds (histograms as their _bucket/_sum/_count series)."""
        response = httpx.get(f"{self.url}/api/v1/label/__name__/values", timeout=5.0)
        response.raise_for_status()
        return set(response.json()["data"])

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        stop_owned(self.proc, timeout_s)
        self._log.close()
        self.proc = None

    def __enter__(self) -> PrometheusServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def evaluate(prometheus: PrometheusServer, queries: Iterable[PanelQuery]) -> list[QueryResult]:
    """Runs each query (macros replaced) as an instant query; errors are returned, not raised."""
    results = []
    for query in queries:
        body = prometheus.query_raw(query.promql)
        ok = body.get("status") == "success"
        results.append(
            QueryResult(
                query,
                body.get("status", "error"),
                "" if ok else str(body.get("error")),
                body["data"]["result"] if ok else [],
            )
        )
    return results
