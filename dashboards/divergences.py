"""Divergence explorer: which requests deviated, at which stage, and why (``stagetrace_divergences``).

Rows are written by the live analyser (``stagetrace agent``, or ``stagetrace analyse`` for a server store) within a
period of a request's arrival, and by ``stagetrace divergences``; the table is a ReplacingMergeTree keyed by
request, read with FINAL so a re-analysed request appears once.
"""

from __future__ import annotations

from stagetrace.dashboards import _panels as p
from stagetrace.dashboards._sql import PIPELINE_ORDER, aggregate, any_selected

UID = "stagetrace-divergences"

SOURCE = "stagetrace_divergences FINAL"
FILTERS = [
    any_selected("ServiceName", "service"),
    any_selected("HostName", "host"),
    any_selected("FirstDivergentStage", "stage"),
]
CAUSE = "if(TopCauseName = '', 'no cause found', concat(TopCauseKind, ': ', TopCauseName))"
# The TP ranks that began a request's difference, as (rank, GPU, the GPU's host) tuples: the analyser stores them as
# three comma-separated lists in the same order (BeganRank, BeganGpu, BeganHost; empty where no rank began it).
BEGAN_PLACES = (
    "if(BeganRank = '', [], arrayZip(splitByChar(',', BeganRank), splitByChar(',', BeganGpu), "
    "splitByChar(',', BeganHost)))"
)
# "Today": the 24 hours to the range's end, whatever the range, as the deviation alert counts a cause's day.
_DAY = "RequestStart > $__toTime - INTERVAL 24 HOUR AND RequestStart <= $__toTime"
BEGAN_TODAY_SQL = f"""
SELECT tupleElement(place, 2) AS gpu, tupleElement(place, 3) AS host,
    arrayStringConcat(arraySort(groupUniqArray(tupleElement(place, 1))), ', ') AS ranks,
    uniqExact(RequestId) AS requests,
    arrayStringConcat(arraySort(groupUniqArray(ServiceName)), ', ') AS services,
    max(RequestStart) AS last_seen
FROM {SOURCE}
ARRAY JOIN {BEGAN_PLACES} AS place
WHERE {_DAY} AND {" AND ".join(FILTERS)}
GROUP BY gpu, host
ORDER BY requests DESC, gpu
LIMIT 100"""

TABLE_SQL = f"""
SELECT RequestStart AS request_start, RequestId AS request_id, ServiceName AS service, HostName AS host,
    FirstDivergentStage AS first_divergent_stage, {CAUSE} AS top_cause, TopCauseValue AS value,
    TopCauseBaselineValue AS baseline_value, TopCauseScore AS score, BaselineRequestId AS baseline_request_id,
    BaselineHow AS baseline, Summary AS summary, DetectedAt AS detected
FROM {SOURCE}
WHERE $__timeFilter(RequestStart) AND {" AND ".join(FILTERS)}
ORDER BY request_start DESC
LIMIT 1000"""


def _distinct(column: str, order: str) -> str:
    return f"SELECT DISTINCT {column} AS value FROM {SOURCE} WHERE $__timeFilter(RequestStart) ORDER BY {order}"


def variables() -> list[dict]:
    return [
        p.datasource_variable(),
        p.query_variable("service", "Service", _distinct("ServiceName", "value")),
        p.query_variable(
            "host", "Host", _distinct("HostName", "value"), description="The host that served the deviating request."
        ),
        p.query_variable(
            "stage",
            "First divergent stage",
            _distinct(
                "FirstDivergentStage", f"indexOf({PIPELINE_ORDER}, value) = 0, indexOf({PIPELINE_ORDER}, value), value"
            ),
        ),
    ]


def panels() -> list[dict]:
    compare = {
        "title": "Compare with its baseline, stage by stage",
        "url": "/d/stagetrace-compare/stagetrace-compare?var-request_id=${__data.fields.request_id:percentencode}"
        "&var-other_request_id=${__data.fields.baseline_request_id:percentencode}"
        "&${datasource:queryparam}",
    }
    links = [
        p.override("request_id", links=[p.trace_lookup_link("request_id"), compare]),
        p.override("baseline_request_id", links=[p.trace_lookup_link("baseline_request_id", "Look up the baseline")]),
        p.override("score", unit="none", decimals=3),
    ]
    per_interval = "Deviating requests per interval"
    return [
        p.stat(
            "Deviating requests analysed",
            aggregate(SOURCE, "RequestStart", {"requests": "count()"}, where=FILTERS, over_time=False),
            "short",
            width=6,
            description="Analysed requests whose output deviated, in the time range.",
        ),
        p.stat(
            "Attributed to hardware",
            aggregate(
                SOURCE,
                "RequestStart",
                {"share": "countIf(TopCauseKind = 'hardware') / nullIf(count(), 0)"},
                where=FILTERS,
                over_time=False,
            ),
            "percentunit",
            width=6,
            description="Share of them whose top-ranked cause is a hardware counter (XID, ECC, RDMA, PFC, MPS).",
        ),
        p.table(
            "Causes by stage",
            aggregate(
                SOURCE,
                "RequestStart",
                {"requests": "count()"},
                labels={"first_divergent_stage": "FirstDivergentStage", "top_cause": CAUSE},
                where=FILTERS,
                over_time=False,
            ),
            "short",
            width=12,
            height=4,
            sort_by="requests",
            description="Deviating requests by first divergent stage and top cause.",
        ),
        p.table(
            "GPUs that began differences today",
            BEGAN_TODAY_SQL,
            "short",
            height=6,
            sort_by="requests",
            description="Each GPU whose TP rank began the difference of deviating requests in the 24 hours to "
            "the range's end (its contribution to a collective differed, or the difference began "
            "inside the stage on it), with that GPU's host (not the request's), and how many "
            "requests it touched. One GPU with many requests and no cause found is a suspected "
            "silent data corruption.",
        ),
        p.table(
            "Deviating requests",
            TABLE_SQL,
            "none",
            height=12,
            overrides=links,
            description="One row per analysed request: click a request ID to open its trace, stages and "
            "hardware in the trace-lookup dashboard.",
        ),
        p.timeseries(
            f"{per_interval} by first divergent stage",
            aggregate(
                SOURCE, "RequestStart", {"requests": "count()"}, labels={"stage": "FirstDivergentStage"}, where=FILTERS
            ),
            "short",
            bars=True,
            description="Where outputs first changed, over time.",
        ),
        p.timeseries(
            f"{per_interval} by top cause",
            aggregate(SOURCE, "RequestStart", {"requests": "count()"}, labels={"cause": CAUSE}, where=FILTERS),
            "short",
            bars=True,
            description="The best-ranked cause of each deviating request, over time.",
        ),
    ]


def build() -> dict:
    return p.dashboard(
        UID,
        "stagetrace: divergence explorer",
        "Requests whose output deviated: first divergent stage, top cause, baseline, with links to each trace.",
        panels(),
        variables(),
        time_from="now-24h",
    )
