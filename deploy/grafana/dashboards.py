"""shellrl's Grafana dashboards as code (grafana-foundation-sdk, the build for Grafana 11.6).

    python deploy/grafana/dashboards.py           # writes deploy/grafana/dashboards/*.json
    python deploy/grafana/dashboards.py --check   # exit 1 when the committed JSON is stale

Grafana (docker-compose.yml) provisions the generated JSON from deploy/grafana/dashboards/ with
the Prometheus datasource of uid `shellrl-prometheus` (deploy/grafana/provisioning/). Every panel
selects series by metric name only (no `job` matchers), so the same JSON works for the compose
stack, the local stack (`shellrl up`) and Kubernetes. tests/helpers/prometheus.py evaluates every
panel's PromQL against a real Prometheus; metric names are those of DESIGN.md section 9 and the
services' metrics.py modules.

Pinned: grafana-foundation-sdk==1769699379!11.6.0 (pyproject dev extra) <-> grafana/grafana:11.6.0.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.builders.common import ReduceDataOptions, VizLegendOptions
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    BigValueGraphMode,
    GraphDrawStyle,
    LegendDisplayMode,
    LegendPlacement,
)
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef
from grafana_foundation_sdk.models.heatmap import HeatmapColorMode

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="shellrl-prometheus")
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    """One panel: `kind` is timeseries, stat or heatmap; `unit` a Grafana unit id (s, short, ...)."""

    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 12
    height: int = 8


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


# --- PromQL helpers ---------------------------------------------------------------------------


def rate_sum(metric: str, by: str = "", matcher: str = "") -> str:
    """Per-second rate of a counter, summed over every instance (optionally grouped `by`)."""
    grouping = f" by ({by})" if by else ""
    return (
        f"sum{grouping} (rate({metric}{{{matcher}}}[{RATE}]))"
        if matcher
        else f"sum{grouping} (rate({metric}[{RATE}]))"
    )


def quantile(histogram: str, q: float, by: str = "") -> str:
    """`histogram_quantile` over the buckets of every instance (Prometheus histograms aggregate)."""
    keys = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({keys}) (rate({histogram}_bucket[{RATE}])))"


def mean(histogram: str, by: str = "") -> str:
    """Mean observation over the rate window: rate(sum) / rate(count)."""
    return f"{rate_sum(histogram + '_sum', by)} / {rate_sum(histogram + '_count', by)}"


def quantile_queries(histogram: str, with_mean: bool = True) -> tuple[Query, ...]:
    queries = tuple(Query(quantile(histogram, q), f"p{round(q * 100)}") for q in QUANTILES)
    return queries + ((Query(mean(histogram), "mean"),) if with_mean else ())


# --- the two dashboards -----------------------------------------------------------------------

STALENESS = (
    Row(
        "Policy version",
        (
            Panel(
                "Policy version",
                (
                    Query("max(shellrl_policy_version)", "learner"),
                    Query("max(shellrl_rollout_learner_version)", "rollout admission"),
                ),
                unit="none",
                description="Optimizer steps taken by the learner, and shellrl:policy:version as the "
                "rollout gateway last read it for admission control.",
            ),
            Panel(
                "Policy version now",
                (Query("max(shellrl_policy_version)", "version"),),
                unit="none",
                kind="stat",
                width=6,
            ),
            Panel(
                "Weight syncs per minute",
                (
                    Query(
                        "60 * "
                        + rate_sum("shellrl_weight_sync_seconds_count", matcher='phase="total"'),
                        "syncs/min",
                    ),
                ),
                unit="none",
                kind="stat",
                width=6,
                description="Completed weight pushes to every engine (phase=total observations).",
            ),
        ),
    ),
    Row(
        "Staleness at training time",
        (
            Panel(
                "Staleness distribution",
                (
                    Query(
                        f"sum by (le) (increase(shellrl_trajectory_staleness_bucket[{RATE}]))",
                        "{{le}}",
                    ),
                ),
                unit="none",
                kind="heatmap",
                description="learner_version - min(segment.policy_version) of the trajectories the learner consumed, "
                "in policy versions (DESIGN.md section 5).",
            ),
            Panel(
                "Staleness percentiles",
                quantile_queries("shellrl_trajectory_staleness"),
                unit="none",
                description="Percentiles and mean of staleness over the window, in policy versions.",
            ),
            Panel(
                "Sample age",
                quantile_queries("shellrl_trajectory_age_seconds"),
                unit="s",
                description="Seconds from the end of an episode to the learner step that trained on it.",
            ),
            Panel(
                "Trajectories into the learner",
                (
                    Query(rate_sum("shellrl_learner_trajectories_trained_total"), "trained"),
                    Query(
                        rate_sum("shellrl_trajectories_dropped_total", by="reason"),
                        "dropped: {{reason}}",
                    ),
                ),
                unit="reqps",
                description="Trajectories per second that entered a training batch, and those dropped.",
            ),
        ),
    ),
    Row(
        "Drops and off-policy corrections",
        (
            Panel(
                "Dropped for staleness",
                (
                    Query(
                        rate_sum("shellrl_trajectories_dropped_total", matcher='reason="stale"'),
                        "stale",
                    ),
                    Query(
                        rate_sum("shellrl_learner_groups_total", by="outcome"),
                        "groups: {{outcome}}",
                    ),
                ),
                unit="reqps",
                description="Trajectories per second dropped because staleness exceeded max_staleness; "
                "released groups per second by outcome.",
            ),
            Panel(
                "Importance-weight truncation",
                (
                    Query(
                        'max(shellrl_learner_importance_weight{stat="truncated_fraction"})',
                        "truncated fraction",
                    ),
                ),
                unit="percentunit",
                description="Fraction of loss tokens of the last step whose behavior importance weight "
                "exp(logp_prox - logp_behavior) was truncated at C (decoupled PPO, DESIGN.md section 5).",
            ),
            Panel(
                "Importance weight",
                (
                    Query(
                        'max by (stat) (shellrl_learner_importance_weight{stat=~"mean|max"})',
                        "{{stat}}",
                    ),
                ),
                unit="none",
                description="Mean and max behavior importance weight of the last step (before truncation).",
            ),
            Panel(
                "Log-prob difference (proximal - behavior)",
                (Query("max by (stat) (shellrl_logprob_diff)", "{{stat}}"),),
                unit="none",
                description="Mean and max |logp_prox - logp_behavior| of version-fresh tokens in the last "
                "step, nats; parity bound 1e-4 (float32 CPU) or 0.02 mean (bf16 GPU).",
            ),
        ),
    ),
)

THROUGHPUT = (
    Row(
        "Rollout",
        (
            Panel(
                "Episodes finished",
                (Query(rate_sum("shellrl_rollout_episodes_total", by="end"), "{{end}}"),),
                unit="reqps",
                description="Episodes per second by how they ended (answer, max_turns, context, failure).",
            ),
            Panel(
                "Episodes in flight",
                (Query("sum(shellrl_episodes_in_flight)", "in flight"),),
                unit="short",
            ),
            Panel(
                "Turns",
                (Query(rate_sum("shellrl_rollout_turns_total"), "turns/s"),),
                unit="reqps",
                description="Model calls (agent turns) per second.",
            ),
            Panel(
                "Tokens per second by kind",
                (
                    Query(rate_sum("shellrl_rollout_tokens_total", by="kind"), "{{kind}}"),
                    Query(rate_sum("shellrl_learner_tokens_total"), "trained (learner)"),
                ),
                unit="short",
                description="Rollout tokens per second: prompt, action (engine-sampled), observation "
                "(harness); and loss-mask tokens the learner trained on.",
            ),
        ),
    ),
    Row(
        "Latency",
        (
            Panel(
                "Sandbox exec latency",
                quantile_queries("shellrl_sandbox_exec_seconds"),
                unit="s",
                description="Wall time of one command in the sandbox, launch to result.",
            ),
            Panel(
                "Sandbox sessions",
                (Query("sum(shellrl_sandbox_sessions)", "open sessions"),),
                unit="short",
            ),
            Panel(
                "Engine request latency",
                quantile_queries("shellrl_rollout_generate_seconds")
                + (
                    Query(
                        f"{quantile('shellrl_engine_request_seconds', 0.9)} or "
                        f"{quantile('sglang:e2e_request_latency_seconds', 0.9)}",
                        "p90 engine-side",
                    ),
                ),
                unit="s",
                description="/generate latency as the rollout sees it (percentiles, mean), and the engine's own "
                "p90 (shellrl CPU engine or SGLang's sglang:e2e_request_latency_seconds).",
            ),
            Panel(
                "Engine generation throughput",
                (
                    Query(
                        f"{rate_sum('shellrl_engine_generation_tokens_total')} or "
                        f"{rate_sum('sglang:generation_tokens_total')}",
                        "generated tokens/s",
                    ),
                ),
                unit="short",
                description="Tokens sampled per second by all engines (shellrl CPU engine or SGLang).",
            ),
            Panel(
                "Verifications",
                (
                    Query(
                        rate_sum("shellrl_verifier_verifications_total", by="outcome"),
                        "{{outcome}}",
                    ),
                ),
                unit="reqps",
                description="Verifications per second by outcome (pass, fail, infra).",
            ),
        ),
    ),
    Row(
        "Terminal",
        (
            Panel(
                "Reward components",
                (
                    Query(
                        mean("shellrl_verifier_reward_component", by="component"), "{{component}}"
                    ),
                ),
                unit="none",
                description="Mean value of each reward component over scored verifications "
                "(unweighted; safety, state_drift and time_efficiency appear when their weight is "
                "set: services/verifier/reward_components.py).",
            ),
            Panel(
                "Safety violations",
                (
                    Query(
                        rate_sum("shellrl_verifier_safety_violations_total", by="level"),
                        "{{level}}",
                    ),
                    Query("max(shellrl_verifier_safety_streak_steps)", "commands since the last"),
                ),
                unit="short",
                description="Episodes the escalating safety penalty hit per second (base -5, "
                "escalated -8), and the run's clean-command streak (escalates at 100).",
            ),
            Panel(
                "Terminal health score",
                (
                    Query("min(shellrl_sandbox_health_score)", "score (worst sandbox)"),
                    Query(
                        "max(shellrl_rollout_sandbox_health_score)", "score as admission read it"
                    ),
                    Query("max(shellrl_sandbox_health_load_per_cpu)", "load per CPU"),
                    Query("min(shellrl_sandbox_health_memory_available_ratio)", "memory available"),
                    Query("min(shellrl_sandbox_health_disk_free_ratio)", "disk free"),
                    Query(
                        "max(shellrl_sandbox_health_exec_latency_seconds)", "exec overhead p90 (s)"
                    ),
                    Query(
                        rate_sum("shellrl_rollout_groups_delayed_unhealthy_total"),
                        "groups delayed/s",
                    ),
                ),
                unit="none",
                description="Terminal health score of the sandbox hosts (0.3 load + 0.3 memory + "
                "0.2 disk + 0.2 exec latency, services/sandbox/host/health.py) and its parts; below the "
                "rollout's sandbox_health_threshold (0.45) new groups are delayed.",
            ),
        ),
    ),
    Row(
        "Learner",
        (
            Panel(
                "Learner step time",
                quantile_queries("shellrl_learner_step_seconds"),
                unit="s",
                description="Wall time of one learner step's training (proximal log-probs, loss, backward, step).",
            ),
            Panel(
                "Weight-sync time by phase",
                (Query(mean("shellrl_weight_sync_seconds", by="phase"), "{{phase}}"),),
                unit="s",
                description="Mean seconds per weight sync, by phase (flatten, transfer, load, verify, total).",
            ),
            Panel(
                "Learner reward and success",
                (
                    Query("max(shellrl_learner_reward)", "mean training reward"),
                    Query("max(shellrl_learner_success_rate)", "success rate"),
                ),
                unit="none",
                description="Of the trajectories trained in the last step.",
            ),
        ),
    ),
    Row(
        "Streams",
        (
            Panel(
                "Stream length",
                (Query("max by (stream) (shellrl_stream_length)", "{{stream}}"),),
                unit="short",
                description="XLEN of each stream.",
            ),
            Panel(
                "Stream backlog",
                (
                    Query(
                        "max by (stream, group) (shellrl_stream_lag)",
                        "{{stream}} / {{group}} not delivered",
                    ),
                    Query(
                        "max by (stream, group) (shellrl_stream_pending)",
                        "{{stream}} / {{group}} pending",
                    ),
                ),
                unit="short",
                description="Entries not yet delivered to a consumer group (lag) and delivered but not "
                "acknowledged (pending).",
            ),
        ),
    ),
)

DASHBOARDS = {
    "staleness": ("shellrl / Staleness", "shellrl-staleness", STALENESS),
    "throughput": ("shellrl / Throughput", "shellrl-throughput", THROUGHPUT),
}


# --- building ---------------------------------------------------------------------------------


def _panel(spec: Panel, panel_id: int):
    if spec.kind == "heatmap":
        colors = (
            heatmap.HeatmapColorOptions().mode(HeatmapColorMode.SCHEME).scheme("Oranges").steps(64)
        )
        builder = (
            heatmap.Panel()
            .calculate(False)
            .color(colors)
            .y_axis(heatmap.YAxisConfig().unit(spec.unit))
            .show_legend()
        )
    elif spec.kind == "stat":
        builder = (
            stat.Panel()
            .graph_mode(BigValueGraphMode.AREA)
            .unit(spec.unit)
            .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        )
    else:
        builder = (
            timeseries.Panel()
            .unit(spec.unit)
            .draw_style(GraphDrawStyle.LINE)
            .line_width(1)
            .fill_opacity(10)
            .legend(_legend())
        )
    builder = (
        builder.id(panel_id)
        .title(spec.title)
        .datasource(DATASOURCE)
        .span(spec.width)
        .height(spec.height if spec.kind != "stat" else 4)
    )
    if spec.description:
        builder = builder.description(spec.description)
    for index, query in enumerate(spec.queries):
        target = (
            prometheus.Dataquery()
            .expr(query.expr)
            .ref_id(chr(ord("A") + index))
            .datasource(DATASOURCE)
        )
        if query.legend:
            target = target.legend_format(query.legend)
        if spec.kind == "heatmap":
            target = target.format("heatmap")
        builder = builder.with_target(target)
    return builder


def _legend():
    return (
        VizLegendOptions()
        .display_mode(LegendDisplayMode.LIST)
        .placement(LegendPlacement.BOTTOM)
        .show_legend(True)
    )


def build(name: str) -> dict:
    """The dashboard `name` (a key of DASHBOARDS) as a JSON-ready dict."""
    title, uid, rows = DASHBOARDS[name]
    board = (
        dashboard.Dashboard(title)
        .uid(uid)
        .tags(["shellrl"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .readonly()
    )
    panel_id = 0
    for row in rows:
        panel_id += 1
        board = board.with_row(dashboard.Row(row.title).id(panel_id))
        for spec in row.panels:
            panel_id += 1
            board = board.with_panel(_panel(spec, panel_id))
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def render(name: str) -> str:
    return json.dumps(build(name), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate shellrl's Grafana dashboards.")
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    stale = []
    for name in DASHBOARDS:
        path, text = args.out / f"{name}.json", render(name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(path)
    if stale:
        print(
            "stale (run python deploy/grafana/dashboards.py): " + ", ".join(stale), file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
