"""Grafana-managed alert rules for the pipeline, evaluated by Grafana over ClickHouse.

Hardware alerts live with Prometheus (``prometheus/hardware.rules.yml``), next to the samples they
read; these read spans and requests, which only ClickHouse holds. Each rule is one ClickHouse query
returning one numeric column per label set (``service``, ``stage``) plus a threshold expression, the
shape Grafana turns into one alert instance per row. The same rules are rendered in both of Grafana's
shapes: the file-provisioning format and the HTTP API's rule-group body.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagetrace.dashboards import _panels as p
from stagetrace.dashboards import build_all
from stagetrace.dashboards import divergences, fabric, overview, weights
from stagetrace.dashboards._sql import (
    DURATION_MS,
    GPU_STEPS,
    MISSING_RANKS_RATIO,
    STAGE,
    STAGES,
    SYNC_SUMMARY,
    TP_REQUESTS,
    TRUNCATED_RATIO,
    aggregate,
)

FOLDER_TITLE = FOLDER_UID = "stagetrace"
GROUP = "stagetrace-pipeline"
INTERVAL_S = 60
ORG_ID = 1
# Too few requests make a ratio or a percentile noise: groups below this are left out of evaluation.
MIN_SAMPLES = 20
ENOUGH = f"count() >= {MIN_SAMPLES}"
# Rank spans reach the store a few seconds after their request's root (each host's exporter batches every 5 s by
# default): the newest requests are left out of rank counts, or they would look as if they lost ranks.
SPAN_LAG_S = 10
# A GPU more steps behind its fleet than this serves older weights than the rest: it missed a sync.
MAX_STEPS_BEHIND = 0

# The live analyser's results (stagetrace_divergences), one alert instance per service, first divergent stage and
# top cause. Grafana turns a rule's text columns into labels, the only text its templates can show, and a label that
# changes makes another instance (and another notification): so the cause's value, the baseline's, the example
# request, the hosts and the devices are those of the cause's requests over the day before, which stay the same
# while it goes on (hosts and devices grow only when the cause reaches another); the number is the range's count.
# ``began``: the TP ranks that began those requests' differences, each with its GPU and that GPU's host (not the
# request's: HostName), as ``explain`` words them ("rank 1 (GPU-..., node-b)"); empty where no rank began one.
_BEGAN = (
    "arrayStringConcat(arraySort(groupUniqArrayArray(arrayMap(p -> concat('rank ', tupleElement(p, 1), ' (', "
    f"tupleElement(p, 2), ', ', tupleElement(p, 3), ')'), {divergences.BEGAN_PLACES}))), '; ')"
)
_LOCATED = "FirstDivergentStage != '' AND TopCauseName != ''"
_DAY = "RequestStart >= $__fromTime - INTERVAL 24 HOUR AND RequestStart <= $__toTime"
_BY_CAUSE = "ServiceName AS service, FirstDivergentStage AS stage, TopCauseName AS cause"
DEVIATING_BY_CAUSE = f"""
SELECT service, stage, cause, value, baseline_value, hosts, devices, began, example_request,
       toFloat64(recent) AS deviating
FROM (
    SELECT {_BY_CAUSE}, argMin(TopCauseValue, RequestStart) AS value,
           argMin(TopCauseBaselineValue, RequestStart) AS baseline_value,
           arrayStringConcat(arraySort(groupUniqArray(HostName)), ' ') AS hosts,
           arrayStringConcat(arraySort(arrayFilter(d -> d != '', groupUniqArrayArray(splitByChar(',', Devices)))),
                             ' ') AS devices,
           {_BEGAN} AS began,
           argMin(RequestId, RequestStart) AS example_request, countIf($__timeFilter(RequestStart)) AS recent
    FROM stagetrace_divergences FINAL
    WHERE {_DAY} AND {_LOCATED}
    GROUP BY service, stage, cause)
WHERE recent > 0"""
NEW_CAUSES = f"""
SELECT {_BY_CAUSE}, argMin(RequestId, RequestStart) AS example_request, toFloat64(count()) AS deviating
FROM stagetrace_divergences FINAL
WHERE $__timeFilter(RequestStart) AND {_LOCATED}
  AND (ServiceName, FirstDivergentStage, TopCauseName) NOT IN (
      SELECT ServiceName, FirstDivergentStage, TopCauseName FROM stagetrace_divergences FINAL
      WHERE RequestStart >= $__fromTime - INTERVAL 24 HOUR AND RequestStart < $__fromTime)
GROUP BY service, stage, cause"""
# Seconds since a live analyser last renewed its lease, where requests arrive: the deviation rules read only its
# results, so without one they would stay quiet (a store no analyser ever ran on counts from 1970).
ANALYSIS_STALLED = """
SELECT 'live analysis' AS analysis,
       toFloat64(dateDiff('second', (SELECT max(Renewed) FROM stagetrace_analyser), $__toTime)) AS seconds_behind
FROM (SELECT count() AS requests FROM stagetrace_requests WHERE $__timeFilter(Start))
WHERE requests > 0"""
EXAMPLE_LINK = f"/d/{p.TRACE_LOOKUP_UID}/{p.TRACE_LOOKUP_UID}?var-request_id={{{{ $labels.example_request }}}}"


@dataclass(frozen=True)
class PipelineRule:
    uid: str
    title: str
    sql: str
    threshold: float  # the alert fires when the query's value is above it
    window_s: int  # the query's time range: now - window_s .. now
    pending: str  # how long the condition must hold ("for")
    summary: str
    description: str
    panel: str  # title of the panel the alert links to
    dashboard: str = overview.UID  # the uid of that panel's dashboard


RULES = (
    PipelineRule(
        "stagetrace-deviating-outputs",
        "Deviating outputs",
        DEVIATING_BY_CAUSE,
        0,
        900,
        "0s",
        "{{ $labels.service }}: {{ $values.A.Value }} deviating output(s) first diverge at {{ $labels.stage }}: "
        "{{ $labels.cause }} is {{ $labels.value }} where the baseline has {{ $labels.baseline_value }} "
        "(hosts {{ $labels.hosts }}; devices {{ $labels.devices }}"
        "{{ if $labels.began }}; began on {{ $labels.began }}{{ end }})",
        "The live analyser found requests whose output differs from the majority output for the same input, first "
        "at this stage, with this top cause. Example request: " + EXAMPLE_LINK + " . Expected changes (rollouts) "
        "and requests that sample without a seed are not counted.",
        "Causes by stage",
        divergences.UID,
    ),
    PipelineRule(
        "stagetrace-new-deviation-cause",
        "New cause of deviation",
        NEW_CAUSES,
        0,
        900,
        "0s",
        "{{ $labels.service }}: a new cause of deviating outputs, {{ $labels.cause }} at {{ $labels.stage }} "
        "({{ $values.A.Value }} request(s))",
        "This stage and top cause had no deviating request in the 24 hours before: something changed. Example "
        "request: " + EXAMPLE_LINK + " .",
        "Causes by stage",
        divergences.UID,
    ),
    PipelineRule(
        "stagetrace-analysis-stalled",
        "Live analysis stalled",
        ANALYSIS_STALLED,
        300,
        900,
        "5m",
        'stagetrace\'s live analysis has not run for {{ $values.A.Value | printf "%.0f" }} s while requests arrive',
        "No live analyser has renewed its lease on this store for more than 5 minutes, yet requests arrive: deviating "
        "outputs reach neither the divergence explorer nor the deviation alerts. With an embedded store the agent "
        "analyses (its log says why it stopped); with a server store run one `stagetrace analyse`.",
        "Deviating requests analysed",
        divergences.UID,
    ),
    PipelineRule(
        "stagetrace-stage-p99-latency",
        "Stage p99 latency",
        aggregate(
            STAGES,
            "Start",
            {"p99_ms": f"quantile(0.99)({DURATION_MS})"},
            labels={"service": "ServiceName", "stage": STAGE},
            having=ENOUGH,
            over_time=False,
        ),
        5000,
        900,
        "10m",
        '{{ $labels.service }} stage {{ $labels.stage }}: p99 latency {{ $values.A.Value | printf "%.0f" }} ms',
        "The 99th percentile duration of a pipeline stage over the last 15 minutes is above 5 s.",
        "Latency of $stage (p50, p95, p99)",
    ),
    PipelineRule(
        "stagetrace-cache-staleness",
        "Stale cache entries",
        aggregate(
            STAGES,
            "Start",
            {"p99_entry_age_s": "quantile(0.99)(toFloat64OrZero(Attributes['cache.entry.age_s']))"},
            labels={"service": "ServiceName"},
            where=[f"{STAGE} = 'cache'", "Attributes['cache.hit'] = 'true'"],
            having=ENOUGH,
            over_time=False,
        ),
        300,
        900,
        "10m",
        '{{ $labels.service }}: cache hits serve entries {{ $values.A.Value | printf "%.0f" }} s old (p99)',
        "The 99th percentile age of cache entries served on a hit (cache.entry.age_s) is above 5 minutes: "
        "answers may be built from documents the index has since replaced.",
        "Cache hit ratio",
    ),
    PipelineRule(
        "stagetrace-context-truncation",
        "Context truncation",
        aggregate(
            STAGES,
            "Start",
            {"truncated": TRUNCATED_RATIO},
            labels={"service": "ServiceName"},
            where=[f"{STAGE} = 'context_assembly'"],
            having=ENOUGH,
            over_time=False,
        ),
        0.05,
        900,
        "10m",
        "{{ $labels.service }}: {{ humanizePercentage $values.A.Value }} of contexts truncated",
        "More than 5% of assembled contexts were cut to fit the token budget (context.truncated): the model saw "
        "less than retrieval found, and outputs change with it.",
        "Context truncation rate",
    ),
    PipelineRule(
        "stagetrace-tp-group-degraded",
        "TP group degraded",
        # grouped by the group's head, not by the hosts of each request: a request that lost a host's ranks has
        # another host list, and would form a new group too small to count
        aggregate(
            TP_REQUESTS,
            "RequestStart",
            {
                "hosts": "arrayStringConcat(arraySort(groupUniqArrayArray(HostList)), ' ')",
                "missing_ranks": MISSING_RANKS_RATIO,
            },
            labels={"service": "ServiceName", "head": "Head"},
            where=["TpSize > 1", f"RequestStart <= $__toTime - {SPAN_LAG_S}"],
            having=ENOUGH,
            over_time=False,
        ),
        0.01,
        300,
        "0s",
        "{{ $labels.service }}: TP group of {{ $labels.head }} ({{ $labels.hosts }}) is missing ranks in "
        "{{ humanizePercentage $values.A.Value }} of requests",
        "Requests whose all-reduce this group ran carry fewer rank spans than its parallel.tp_size: a host of the "
        "tensor-parallel group stopped reporting (failed mid-run, or its agent or network is down). "
        "The Fabric dashboard's TP hosts panel shows when each host was last seen and last scraped.",
        "Requests missing TP ranks",
        fabric.UID,
    ),
    PipelineRule(
        "stagetrace-weights-behind",
        "GPU serves older weights",
        "SELECT ServiceName AS service, HostName AS host, Gpu AS gpu, toString(FleetStep) AS fleet_step, "
        f"toFloat64(StepsBehind) AS steps_behind FROM {GPU_STEPS}",
        MAX_STEPS_BEHIND,
        300,
        "1m",
        "{{ $labels.host }} {{ $labels.gpu }} serves weights {{ $values.A.Value }} step(s) behind its fleet "
        "(step {{ $labels.fleet_step }})",
        "The GPU's latest decode spans carry an older model.weights.step than most GPUs of its service: it missed a "
        "weight sync and its outputs come from older weights. The Weights dashboard shows when each step arrived; "
        "`stagetrace explain` on one of its requests names the step.",
        "Step served per GPU",
        weights.UID,
    ),
    PipelineRule(
        "stagetrace-weights-fan-in",
        "Weight syncs funnel through one NIC",
        f"SELECT ServiceName AS service, countIf(FanIn) / count() AS fan_in FROM {SYNC_SUMMARY} GROUP BY service",
        0.5,
        1800,
        "0s",
        "{{ $labels.service }}: {{ humanizePercentage $values.A.Value }} of weight syncs funnel through one NIC",
        "Most weight syncs of the last 30 minutes sent most of their bytes through one NIC (the rank-0 pattern: "
        "gather on one training GPU, send from there), so they run at one NIC's speed. Writing each rank's shard "
        "from every training GPU uses every NIC.",
        "Fan-in: busiest NIC's share",
        weights.UID,
    ),
)


def _data(rule: PipelineRule) -> list[dict]:
    query = {
        "refId": "A",
        "queryType": "",
        "relativeTimeRange": {"from": rule.window_s, "to": 0},
        "datasourceUid": p.DATASOURCE_UID,
        "model": {
            "refId": "A",
            "datasource": {"type": p.DATASOURCE_TYPE, "uid": p.DATASOURCE_UID},
            "editorType": "sql",
            "format": p.TABLE,  # a table with string label columns and one number: one alert instance per row
            "queryType": "table",
            "rawSql": rule.sql,
            "intervalMs": 1000,
            "maxDataPoints": 43200,
        },
    }
    threshold = {
        "refId": "C",
        "queryType": "",
        "relativeTimeRange": {"from": 0, "to": 0},  # expressions take no time range
        "datasourceUid": "__expr__",
        "model": {
            "refId": "C",
            "datasource": {"type": "__expr__", "uid": "__expr__"},
            "type": "threshold",
            "expression": "A",
            "conditions": [{"evaluator": {"type": "gt", "params": [rule.threshold]}}],
        },
    }
    return [query, threshold]


def _panel_ids() -> dict[str, int]:
    """Each rule's panel ID on its dashboard, from one build of the dashboards."""
    built = build_all()
    ids = {}
    for rule in RULES:
        found = [panel["id"] for panel in built[rule.dashboard]["panels"] if panel["title"] == rule.panel]
        if not found:
            raise LookupError(f"the {rule.dashboard} dashboard has no panel titled {rule.panel!r}")
        ids[rule.uid] = found[0]
    return ids


def _rule(rule: PipelineRule) -> dict:
    """The fields both formats share."""
    return {
        "uid": rule.uid,
        "title": rule.title,
        "condition": "C",
        "data": _data(rule),
        "noDataState": "OK",  # no traffic is not an incident
        "execErrState": "Error",
        "for": rule.pending,
        "annotations": {"summary": rule.summary, "description": rule.description},
        "labels": {"severity": "warning", "source": "stagetrace"},
        "isPaused": False,
    }


def file_provisioning() -> dict:
    """``provisioning/alerting/stagetrace.yaml``: the rule group, in Grafana's file format."""
    panel_ids = _panel_ids()
    rules = [{**_rule(r), "dashboardUid": r.dashboard, "panelId": panel_ids[r.uid]} for r in RULES]
    return {
        "apiVersion": 1,
        "groups": [
            {"orgId": ORG_ID, "name": GROUP, "folder": FOLDER_TITLE, "interval": f"{INTERVAL_S}s", "rules": rules}
        ],
    }


def api_rule_group() -> dict:
    """The body of ``PUT /api/v1/provisioning/folder/{folder}/rule-groups/{group}``."""
    rules, panel_ids = [], _panel_ids()
    for rule in RULES:
        body = _rule(rule)
        body["annotations"] = {
            **body["annotations"],
            "__dashboardUid__": rule.dashboard,
            "__panelId__": str(panel_ids[rule.uid]),
        }
        rules.append({**body, "orgID": ORG_ID, "folderUID": FOLDER_UID, "ruleGroup": GROUP})
    return {"title": GROUP, "folderUid": FOLDER_UID, "interval": INTERVAL_S, "rules": rules}
