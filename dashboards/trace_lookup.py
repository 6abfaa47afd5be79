"""Trace lookup by request ID: the request, its trace, its stages, and the hardware it ran on.

Everything is found from the request ID alone (``stagetrace_requests`` is ordered by it), so the
dashboard's time picker does not matter here: a request from last week is found without widening it.
"""

from __future__ import annotations

from stagetrace.dashboards import _panels as p
from stagetrace import conventions
from stagetrace.dashboards._sql import HOST, LOGS, PIPELINE_ORDER, REQUEST_ID, SPANS, STAGE, STAGES, peer_key

UID = p.TRACE_LOOKUP_UID

# The ID the request is stored under, by the CLI's rule (conventions.request_id_candidates): the ID as typed, else
# Dynamo's response ID (``chatcmpl-<id>``, ``cmpl-<id>``) as the bare ID its spans record.
STORED_ID = conventions.stored_request_id_sql(REQUEST_ID)
# The newest root span with that request ID (a retried request keeps its ID): (trace ID, start, end).
REQUEST = (
    f"(SELECT (TraceId, Start, End) FROM stagetrace_requests WHERE RequestId = {STORED_ID} ORDER BY Start DESC LIMIT 1)"
)
REQUEST_SPANS = "TraceId = trace_id AND Timestamp >= request_start AND Timestamp <= request_end"
# net.rdma.devices is a JSON array when the SDK set a list, else a comma-separated string
RDMA_DEVICES = (
    "if(startsWith(SpanAttributes['net.rdma.devices'], '['), "
    "JSONExtract(SpanAttributes['net.rdma.devices'], 'Array(String)'), "
    "splitByChar(',', SpanAttributes['net.rdma.devices']))"
)
# How far back "recently" reaches: a fault shortly before a request (an XID) can still corrupt it.
RECENT = "INTERVAL 10 MINUTE"
# Samples are read this far around the request: enough to find the samples bracketing it and RECENT.
SAMPLE_SEARCH = "INTERVAL 20 MINUTE"

REQUEST_CONTEXT = f"""
WITH
    {REQUEST} AS request,
    request.1 AS trace_id,
    request.2 AS request_start,
    request.3 AS request_end"""

# The hosts, GPUs (gpu.uuid), RDMA ports (net.rdma.devices) and their netdevs the request's spans name.
HARDWARE_CONTEXT = f"""{REQUEST_CONTEXT},
    (SELECT (groupUniqArray({HOST}), groupUniqArrayIf(SpanAttributes['gpu.uuid'], SpanAttributes['gpu.uuid'] != ''),
             groupUniqArrayArrayIf(arrayMap(device -> ({HOST}, device), arrayFilter(device -> device != '', {RDMA_DEVICES})),
                                   SpanAttributes['net.rdma.devices'] != ''))
       FROM {SPANS} WHERE {REQUEST_SPANS}) AS named,  -- one read of the request's spans
    named.1 AS hosts,
    named.2 AS gpus,
    named.3 AS nics,
    (SELECT groupUniqArray(({HOST}, Attributes['netdev'])) FROM otel_metrics_gauge
       WHERE MetricName = 'rdma_port_info' AND has(nics, ({HOST}, Attributes['device']))
         AND TimeUnix >= request_start - {SAMPLE_SEARCH} AND TimeUnix <= request_end + {SAMPLE_SEARCH}) AS netdevs"""

# Series of that hardware: the named GPUs (every GPU of the hosts when no span names one), the named
# RDMA ports and their netdevs, and the hosts' own series (collector health, MPS servers).
ON_REQUEST_HARDWARE = (
    "has(gpus, Attributes['uuid'])"
    " OR (empty(gpus) AND mapContains(Attributes, 'uuid') AND has(hosts, host))"
    " OR has(nics, (host, Attributes['device']))"
    " OR has(netdevs, (host, Attributes['netdev']))"
    " OR (has(hosts, host) AND NOT mapContains(Attributes, 'uuid') AND NOT mapContains(Attributes, 'device')"
    " AND NOT mapContains(Attributes, 'netdev'))"
)
DEVICE = (
    "multiIf(mapContains(Attributes, 'uuid'), concat('GPU ', Attributes['gpu'], ' ', Attributes['uuid']), "
    "mapContains(Attributes, 'device'), concat(Attributes['device'], '/', Attributes['port']), "
    "mapContains(Attributes, 'netdev'), Attributes['netdev'], '')"
)
OTHER_LABELS = (
    "arrayStringConcat(arrayMap(k -> concat(k, '=', Attributes[k]), arraySort(arrayFilter("
    "k -> k NOT IN ('gpu', 'uuid', 'model', 'device', 'port', 'netdev'), mapKeys(Attributes)))), ' ')"
)
# The last sample at or before a moment: 0 when there is none, as XID series appear at their first event.
BEFORE = "argMaxIf(Value, TimeUnix, TimeUnix <= request_start)"
RECENTLY_BEFORE = f"argMaxIf(Value, TimeUnix, TimeUnix <= request_start - {RECENT})"
# The first sample at or after the request's end; NULL until the agent has taken one.
AFTER = "if(countIf(TimeUnix >= request_end) > 0, argMinIf(Value, TimeUnix, TimeUnix >= request_end), NULL)"


def _increase(new: str, old: str) -> str:
    # a decrease is a reset: the new value is the increase
    return f"if({new} >= {old}, {new} - {old}, {new})"


def hardware_samples(table: str, where: str = "") -> str:
    return f"""{HARDWARE_CONTEXT}
SELECT {HOST} AS host, {DEVICE} AS device, MetricName AS metric, {OTHER_LABELS} AS labels,
    {RECENTLY_BEFORE} AS recently_before, {BEFORE} AS before, {AFTER} AS after
FROM {table}
WHERE TimeUnix >= request_start - {SAMPLE_SEARCH} AND TimeUnix <= request_end + {SAMPLE_SEARCH}
  AND ({ON_REQUEST_HARDWARE}){where}
GROUP BY host, device, metric, labels"""


SUMMARY_SQL = f"""
WITH
    (SELECT (InputDigest, OutputDigest, Start, TraceId) FROM stagetrace_requests WHERE RequestId = {STORED_ID}
       ORDER BY Start DESC LIMIT 1) AS request,
    request.3 - INTERVAL 1 DAY AS since,
    request.3 + INTERVAL 1 DAY AS until,
    -- its peer key (its service and model: _sql.peer_key), from its trace's root rows as the analysis reads it
    (SELECT {peer_key()} FROM ({conventions.requests_sql("TraceId = request.4", model=True)})) AS peer,
    -- the outputs of the requests with its input and its peer key: another service's answers to the same prompt
    -- are not compared
    (SELECT groupArray((OutputDigest, requests)) FROM (
        SELECT OutputDigest, count() AS requests FROM ({
    conventions.requests_sql(
        "TraceId IN (SELECT TraceId FROM stagetrace_requests WHERE InputDigest = request.1 AND Start >= since "
        "AND Start <= until)",
        model=True,
    )
})
        WHERE InputDigest = request.1 AND {peer_key()} = peer GROUP BY OutputDigest)) AS outputs,
    arraySum(o -> o.2, outputs) AS same_input,
    arraySum(o -> if(o.1 = request.2, o.2, 0), outputs) AS same_output,
    arrayFilter(o -> o.1 != '', outputs) AS answered,
    -- as _sql.majority_outputs: the most common output, where the input was answered at least twice
    if(arraySum(o -> o.2, answered) >= 2, arrayFirst(o -> o.2 = arrayMax(o -> o.2, answered), answered).1, '')
      AS majority_output
SELECT RequestId AS request_id, TraceId AS trace_id, ServiceName AS service, HostName AS host, Start AS start,
    dateDiff('microsecond', Start, End) / 1000 AS duration_ms, StatusCode AS status,
    InputDigest AS input_digest, OutputDigest AS output_digest,
    same_input AS requests_with_same_input, same_output AS requests_with_same_output,
    multiIf(majority_output = '', 'unknown: input seen once', OutputDigest = majority_output, 'no', 'yes') AS deviates
FROM stagetrace_requests
WHERE RequestId = {STORED_ID}
ORDER BY Start DESC
LIMIT 1"""

# The plugin's trace-ID query with its *_trace_id_ts bounds (src/data/sqlGenerator.ts), aliases as its Traces
# format expects; events become span logs and links become references.
TRACE_SQL = f"""
WITH
    {REQUEST}.1 AS trace_id,
    (SELECT min(Start) FROM otel_traces_trace_id_ts WHERE TraceId = trace_id) AS trace_start,
    (SELECT max(End) + 1 FROM otel_traces_trace_id_ts WHERE TraceId = trace_id) AS trace_end
SELECT
    TraceId AS traceID,
    SpanId AS spanID,
    ParentSpanId AS parentSpanID,
    ServiceName AS serviceName,
    SpanName AS operationName,
    multiply(toUnixTimestamp64Nano(Timestamp), 0.000001) AS startTime,
    multiply(Duration, 0.000001) AS duration,
    arrayMap(key -> map('key', key, 'value', SpanAttributes[key]), mapKeys(SpanAttributes)) AS tags,
    arrayMap(key -> map('key', key, 'value', ResourceAttributes[key]), mapKeys(ResourceAttributes)) AS serviceTags,
    SpanKind AS kind,
    if(StatusCode IN ('Error', 'STATUS_CODE_ERROR'), 2, 0) AS statusCode,
    StatusMessage AS statusMessage,
    ScopeName AS instrumentationLibraryName,
    ScopeVersion AS instrumentationLibraryVersion,
    TraceState AS traceState,
    arrayMap((name, timestamp, attributes) -> tuple(name, toString(toUnixTimestamp64Milli(timestamp)),
        arrayMap(key -> map('key', key, 'value', attributes[key]), mapKeys(attributes)))
        ::Tuple(name String, timestamp String, fields Array(Map(String, String))),
        Events.Name, Events.Timestamp, Events.Attributes) AS logs,
    arrayMap((traceID, spanID, attributes) -> tuple(traceID, spanID,
        arrayMap(key -> map('key', key, 'value', attributes[key]), mapKeys(attributes)))
        ::Tuple(traceID String, spanID String, tags Array(Map(String, String))),
        Links.TraceId, Links.SpanId, Links.Attributes) AS references
FROM {SPANS}
WHERE TraceId = trace_id AND Timestamp >= trace_start AND Timestamp <= trace_end
ORDER BY startTime ASC"""

# The request's log lines (otel_logs, read as LOGS): by the bloom filter on TraceId inside the request's time, a minute either side.
LOGS_SQL = f"""{REQUEST_CONTEXT}
SELECT Timestamp AS timestamp, Body AS body, lower(SeverityText) AS level, ServiceName AS service, SpanId AS span_id
FROM {LOGS}
WHERE TraceId = trace_id AND Timestamp >= request_start - INTERVAL 1 MINUTE AND Timestamp <= request_end + INTERVAL 1 MINUTE
ORDER BY Timestamp"""

# The request's stage spans as the store named them (any producer's conventions), content left out.
STAGES_SQL = f"""{REQUEST_CONTEXT}
SELECT {STAGE} AS stage, SpanName AS span, ServiceName AS service, HostName AS host, Start AS start,
    Duration / 1e6 AS duration_ms, InputDigest AS input_digest, OutputDigest AS output_digest,
    arrayStringConcat(arrayMap(k -> concat(k, '=', Attributes[k]),
        arraySort(arrayFilter(k -> NOT startsWith(k, 'stagetrace.'), mapKeys(Attributes)))), '  ') AS attributes
FROM {STAGES}
WHERE TraceId = trace_id AND Start >= request_start - INTERVAL 1 MINUTE AND Start <= request_end + INTERVAL 1 MINUTE
ORDER BY indexOf({PIPELINE_ORDER}, stage) = 0, indexOf({PIPELINE_ORDER}, stage), start"""

DIVERGENCE_SQL = f"""
SELECT DetectedAt AS detected, FirstDivergentStage AS first_divergent_stage, BaselineRequestId AS baseline_request_id,
    BaselineHow AS baseline, TopCauseKind AS cause_kind, TopCauseName AS cause, TopCauseValue AS value,
    TopCauseBaselineValue AS baseline_value, TopCauseScore AS score, Summary AS summary
FROM stagetrace_divergences FINAL
WHERE RequestId = {STORED_ID}"""

HOSTS_SQL = f"""{REQUEST_CONTEXT}
SELECT {HOST} AS host,
    arrayStringConcat(arrayFilter(s -> s != '', groupUniqArray(s.Stage)), ', ') AS stages,
    count() AS spans,
    arrayStringConcat(groupUniqArrayIf(SpanAttributes['gpu.uuid'], SpanAttributes['gpu.uuid'] != ''), ', ') AS gpus,
    arrayStringConcat(arrayFilter(d -> d != '', groupUniqArrayArray({RDMA_DEVICES})), ', ') AS rdma_devices
FROM {SPANS} AS spans
LEFT JOIN (SELECT SpanId, any(Stage) AS Stage FROM {STAGES}
           WHERE TraceId = trace_id AND Start >= request_start - INTERVAL 1 MINUTE
             AND Start <= request_end + INTERVAL 1 MINUTE
           GROUP BY SpanId) AS s
    ON spans.SpanId = s.SpanId
WHERE {REQUEST_SPANS}
GROUP BY host
ORDER BY host"""

COUNTERS_SQL = f"""
SELECT host, device, metric, labels, {_increase("after", "before")} AS during_request,
    {_increase("before", "recently_before")} AS in_10_min_before, before, after
FROM ({hardware_samples("otel_metrics_sum")})
ORDER BY during_request DESC, in_10_min_before DESC, host, device, metric, labels"""

GAUGES_SQL = f"""
SELECT host, device, metric, labels, before, after
FROM ({hardware_samples("otel_metrics_gauge", " AND NOT endsWith(MetricName, '_info')")})
ORDER BY host, device, metric, labels"""


def panels() -> list[dict]:
    ms = p.override("duration_ms", unit="ms")
    return [
        p.table(
            "Request",
            SUMMARY_SQL,
            "none",
            height=5,
            overrides=[ms],
            description="The request's root span; deviates compares its output with the majority output of "
            "requests with the same input digest, in the same service for the same model, within "
            "a day of it.",
        ),
        p.traces("Trace", TRACE_SQL, description="Every span of the request's trace."),
        p.logs(
            "Log lines",
            LOGS_SQL,
            description="The engines' own log lines of the request's trace (otel_logs): "
            "preemptions, fallbacks, warnings, as they were sent.",
        ),
        p.table(
            "Stages",
            STAGES_SQL,
            "none",
            height=8,
            overrides=[ms],
            description="Stage spans in pipeline order: input and output digests show where the output changed; "
            "attributes show how each stage ran.",
        ),
        p.table(
            "Divergence analysis",
            DIVERGENCE_SQL,
            "none",
            height=5,
            overrides=[
                p.override(
                    "baseline_request_id", links=[p.trace_lookup_link("baseline_request_id", "Look up the baseline")]
                )
            ],
            description="The result of `stagetrace explain` for this request, when it has been analysed.",
        ),
        p.row("Hardware the request ran on"),
        p.table(
            "Hosts",
            HOSTS_SQL,
            "none",
            height=5,
            description="Hosts the request's spans ran on, with the GPUs and RDMA devices the spans name.",
        ),
        p.table(
            "Counters over the request's window",
            COUNTERS_SQL,
            "short",
            height=10,
            sort_by="during_request",
            description="Counters of those GPUs, RDMA ports, netdevs and hosts: during_request is their increase "
            "from the last sample before the request started to the first sample after it ended; "
            "in_10_min_before the increase in the ten minutes before it (a fault there can still "
            "corrupt it). A series with no earlier sample counts from zero, as XID series appear at "
            "their first event; a decrease is a reset. Anything that rose is a hardware suspect.",
        ),
        p.table(
            "Gauges around the request",
            GAUGES_SQL,
            "short",
            height=10,
            description="The same hardware's gauges at the samples just before and just after the request: "
            "utilization, temperature, clocks and throttle reasons, port state, MPS clients.",
        ),
    ]


def variables() -> list[dict]:
    return [
        p.datasource_variable(),
        p.text_variable(
            "request_id",
            "Request ID",
            "The request's stagetrace.request.id (or gen_ai.request.id), e.g. from a log line or "
            "`stagetrace divergences`; for NVIDIA Dynamo also the id of its response (chatcmpl-..., cmpl-...).",
        ),
    ]


def build() -> dict:
    return p.dashboard(
        UID,
        "stagetrace: trace lookup",
        "Set Request ID: the request's trace, its stages with digests and attributes, and the GPUs, NICs and hosts "
        "it ran on with their counters over its window.",
        panels(),
        variables(),
        time_from="now-24h",
        refresh="",
    )
