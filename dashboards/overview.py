"""Pipeline overview: is the pipeline serving, are outputs stable, and which stage or host is slow or odd."""

from __future__ import annotations

from stagetrace.dashboards import _panels as p
from stagetrace.dashboards._sql import (
    ALLREDUCE_TIME_SHARE,
    CACHE_HIT_RATIO,
    DEVIATING_RATIO,
    DURATION_MS,
    HOST,
    PIPELINE_ORDER,
    REQUESTS,
    REQUESTS_WITH_MAJORITY,
    SPANS,
    STAGE,
    STAGES,
    TRUNCATED_RATIO,
    aggregate,
    any_selected,
)

UID = "stagetrace-overview"

SPAN_FILTERS = [any_selected("ServiceName", "service"), any_selected(HOST, "host")]
REQUEST_FILTERS = [any_selected("r.ServiceName", "service"), any_selected("r.HostName", "host")]
BY_SERVICE_AND_HOST = {"service": "ServiceName", "host": HOST}


def stage_spans(stage: str) -> list[str]:
    return [f"{STAGE} = '{stage}'", *SPAN_FILTERS]


def requests_per_second(over_time: bool) -> str:
    labels = {"service": "ServiceName", "host": "HostName"} if over_time else {}
    value = "count() / $__interval_s" if over_time else "count()"
    return aggregate(
        REQUESTS,
        "Start",
        {"requests": value},
        labels=labels,
        over_time=over_time,
        where=[any_selected("ServiceName", "service"), any_selected("HostName", "host")],
    )


def deviating_ratio(over_time: bool) -> str:
    labels = {"service": "r.ServiceName", "host": "r.HostName"} if over_time else {}
    return aggregate(
        REQUESTS_WITH_MAJORITY,
        "r.Start",
        {"deviating": DEVIATING_RATIO},
        labels=labels,
        where=REQUEST_FILTERS,
        over_time=over_time,
    )


def stage_ratio(stage: str, ratio: str, name: str, over_time: bool) -> str:
    return aggregate(
        STAGES,
        "Start",
        {name: ratio},
        labels=BY_SERVICE_AND_HOST if over_time else {},
        where=stage_spans(stage),
        over_time=over_time,
    )


def stage_variable() -> dict:
    # pipeline order first, then any other stage by when it was first seen (docs/design.md#span-conventions)
    sql = (
        f"SELECT stage FROM (SELECT {STAGE} AS stage, min(Start) AS first_seen FROM {STAGES} "
        f"WHERE $__timeFilter(Start) GROUP BY stage) "
        f"ORDER BY indexOf({PIPELINE_ORDER}, stage) = 0, indexOf({PIPELINE_ORDER}, stage), first_seen"
    )
    return p.query_variable("stage", "Stage", sql, description="Stages whose latency panels are shown.")


def variables() -> list[dict]:
    return [
        p.datasource_variable(),
        p.query_variable(
            "service",
            "Service",
            "SELECT DISTINCT ServiceName FROM stagetrace_requests WHERE $__timeFilter(Start) ORDER BY ServiceName",
            description="service.name of the pipeline's spans.",
        ),
        p.query_variable(
            "host",
            "Host",
            f"SELECT DISTINCT {HOST} AS host FROM {SPANS} WHERE $__timeFilter(Timestamp) "
            f"AND {any_selected('ServiceName', 'service')} ORDER BY host",
            description="host.name of the spans: where a request or stage ran.",
        ),
        stage_variable(),
    ]


def panels() -> list[dict]:
    return [
        p.row("Requests and outputs"),
        p.stat(
            "Requests",
            requests_per_second(over_time=False),
            "short",
            description="Requests served in the time range (one per trace: the span with a request ID, "
            "else the trace's root span).",
        ),
        p.stat(
            "Deviating outputs",
            deviating_ratio(over_time=False),
            "percentunit",
            thresholds=[(0.01, "red")],
            description="Share of requests whose output differs from the majority output of requests with "
            "the same input digest (inputs seen at least twice in the range).",
        ),
        p.stat(
            "Cache hit ratio",
            stage_ratio("cache", CACHE_HIT_RATIO, "hit_ratio", over_time=False),
            "percentunit",
            description="Share of cache-stage spans with cache.hit = true.",
        ),
        p.stat(
            "Truncated contexts",
            stage_ratio("context_assembly", TRUNCATED_RATIO, "truncated", over_time=False),
            "percentunit",
            thresholds=[(0.05, "orange")],
            description="Share of context-assembly spans with context.truncated = true: the model saw less "
            "context than retrieval found.",
        ),
        p.stat(
            "All-reduce time share",
            aggregate(SPANS, "Timestamp", {"share": ALLREDUCE_TIME_SHARE}, where=SPAN_FILTERS, over_time=False),
            "percentunit",
            description="Time in all-reduce stages over total request time.",
        ),
        p.stat(
            "p99 request latency",
            aggregate(
                REQUESTS,
                "Start",
                {"p99": "quantile(0.99)(dateDiff('microsecond', Start, End)) / 1000"},
                where=[any_selected("ServiceName", "service"), any_selected("HostName", "host")],
                over_time=False,
            ),
            "ms",
            description="99th percentile of request duration (root span) in the time range.",
        ),
        p.timeseries(
            "Request rate",
            requests_per_second(over_time=True),
            "reqps",
            description="Requests started per second, by service and host.",
        ),
        p.timeseries(
            "Deviating-output rate",
            deviating_ratio(over_time=True),
            "percentunit",
            max_value=1,
            description="Per interval, the share of requests whose output differs from the majority output "
            "for the same input. Open the divergence explorer to see which stage and cause.",
        ),
        p.row("Stages"),
        p.timeseries(
            "Latency of $stage (p50, p95, p99)",
            aggregate(
                STAGES,
                "Start",
                {f"p{q}": f"quantile(0.{q})({DURATION_MS})" for q in (50, 95, 99)},
                where=[f"{STAGE} IN (${{stage:singlequote}})", *SPAN_FILTERS],
            ),
            "ms",
            width=8,
            repeat="stage",
            description="Stage span duration percentiles per interval; one panel per selected stage.",
        ),
        p.timeseries(
            "Cache hit ratio",
            stage_ratio("cache", CACHE_HIT_RATIO, "hit_ratio", over_time=True),
            "percentunit",
            width=8,
            max_value=1,
            description="Share of cache lookups that hit, by service and host.",
        ),
        p.timeseries(
            "Context truncation rate",
            stage_ratio("context_assembly", TRUNCATED_RATIO, "truncated", over_time=True),
            "percentunit",
            width=8,
            max_value=1,
            description="Share of assembled contexts cut to fit the token budget.",
        ),
        p.timeseries(
            "All-reduce time share",
            aggregate(
                SPANS, "Timestamp", {"share": ALLREDUCE_TIME_SHARE}, labels=BY_SERVICE_AND_HOST, where=SPAN_FILTERS
            ),
            "percentunit",
            width=8,
            max_value=1,
            description="Time spent in all-reduce over total request time: a rise points at the fabric "
            "(see the RDMA fabric dashboard).",
        ),
    ]


def build() -> dict:
    return p.dashboard(
        UID,
        "stagetrace: pipeline overview",
        "Request rate, deviating outputs, stage latency, cache, truncation and all-reduce share, by service and host.",
        panels(),
        variables(),
    )
