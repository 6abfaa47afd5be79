"""The ClickHouse schema: DDL for one node or a cluster, and its idempotent creation.

The ``otel_*`` tables follow the column names and types of the OpenTelemetry Collector's
``clickhouseexporter`` in its widely deployed generation (bloom-filter indexes, ``DateTime64(9)``
metric timestamps), so the Collector and stagetrace's own exporters write the same tables and
Grafana's ClickHouse data source reads either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stagetrace import attributes
from stagetrace import conventions as cv
from stagetrace.errors import SchemaError  # re-exported: callers catch it from here
from stagetrace.part_guard import SOURCES_KEPT_S

# 2: stagetrace_stages; 3: deduplication window for idempotent (spool) inserts;
# 4: requests and stages of other producers' conventions (stagetrace.conventions), content digested in the store;
# 5: why a request or stage is nondeterministic by design (conventions.NONDETERMINISM_SQL)
# 6: the requests view rebuilt (REBUILDS); 7: stagetrace_analyser, the live analyser's lease and progress, and the
# divergent stage's GPUs (else NICs) in stagetrace_divergences.Devices, for the alerts' summaries; 8: the requests
# in trace order (projection by_trace); 9: the requests' digests in input order (by_input); 10: otel_logs;
# 11: the requests' and stages' views in two, spans with content apart (the same rows, cheaper: issue 32);
# 12: the request's model (stagetrace_requests.Model, conventions.MODEL_SQL), part of its peer key (issue 51), and
# the parts a merge replaced kept 120 s on an embedded store (its durable settings: issue 50);
# 13: engines' roots that are no request (start-up, loading, SGLang's KV sender) not listed as requests, an
# engine's unrecorded seed unknown, not absent, and SGLang's KV transfer the cache stage (issue 53);
# 14: vLLM's start-up roots known by their code.namespace, a request's model read from its resource where its
# span names none (vLLM's llm_request), and a stage's rank on a pipeline stage other than 0 named with it (issue 53);
# 15: the views read the Collector's JSON attribute layout as its Map layout, and stagetrace_spans / stagetrace_logs,
# the span and log tables with Map attributes whatever the layout, for lookups and dashboards (issue 55);
# 16: the TP ranks that began each divergence, their GPUs and hosts, in stagetrace_divergences.BeganRank, BeganGpu
# and BeganHost (one entry per rank, in the same order), for /metrics, the alerts and the dashboards (issue 52);
# 17: NVIDIA Dynamo's spans: its frontend root a request by its x_request_id or request_id, its system roots no
# request, its worker's handle_payload the decode stage (issue 53)
# 18: stagetrace_models, the models spans below a request's roots name (conventions.OWN_MODEL_SQL), its model where
# its root rows name none (conventions.requests_sql), as an application's root above an engine's span (issue 51)
# 19: SGLang's model gateway (smg): its http_request span of a model route a request by its request_id (the
# client's x-request-id), its spans of other routes (readiness, health) no request (issue 53)
SCHEMA_VERSION = 19

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


def identifier(name: str, what: str = "name") -> str:
    """Back-quote a validated identifier; DDL cannot take identifiers as query parameters."""
    if not _IDENTIFIER.match(name or ""):
        raise SchemaError(f"invalid {what} {name!r}: use letters, digits and underscores, starting with a letter")
    return f"`{name}`"


_MAP = "Map(LowCardinality(String), String)"

# A replayed batch carries its insert_deduplication_token; a non-replicated MergeTree drops a repeat only
# within this many recent blocks. Views' target tables need it too: the token reaches them, and without it
# a deduplicated insert into otel_traces would still add its rows to the views' tables.
_DEDUP = "non_replicated_deduplication_window = 1000"

# A trace's request rows by trace ID (a lookup by trace ID, and the request fields of a lookup by request ID), read
# from a copy of the table in trace order: a bounded number of granules however large the store.
# A trace's spans sit in one granule per span name (otel_traces) and per stage (stagetrace_stages), found by the
# bloom filter on TraceId and the time; a lookup reads those granules whole, so they are an eighth of the Collector's
# 8192 rows: the span read of a lookup takes half the time (11.0 against 21.5 ms p50 at 21.6M spans) for 0.6% more
# disk and eight times the marks. A store the Collector created keeps its 8192 (a granularity is fixed at creation).
_LOOKUP_GRANULARITY = 1024
_BY_TRACE, _BY_TRACE_SELECT = "by_trace", "SELECT * ORDER BY TraceId, Start"
# the same-input requests of one input (the trace lookup's summary, a live pass's new inputs) by key: narrow, as only
# what those queries read
_BY_INPUT, _BY_INPUT_SELECT = "by_input", "SELECT InputDigest, OutputDigest, Start, TraceId ORDER BY InputDigest, Start"

_ATTRIBUTE_INDEXES = """
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1"""

_METRIC_COMMON = f"""
    ResourceAttributes {_MAP} CODEC(ZSTD(1)),
    ResourceSchemaUrl String CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    ScopeAttributes {_MAP} CODEC(ZSTD(1)),
    ScopeDroppedAttrCount UInt32 CODEC(ZSTD(1)),
    ScopeSchemaUrl String CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    MetricName String CODEC(ZSTD(1)),
    MetricDescription String CODEC(ZSTD(1)),
    MetricUnit String CODEC(ZSTD(1)),
    Attributes {_MAP} CODEC(ZSTD(1)),
    StartTimeUnix DateTime64(9) CODEC(Delta, ZSTD(1)),
    TimeUnix DateTime64(9) CODEC(Delta, ZSTD(1)),
    Value Float64 CODEC(ZSTD(1)),
    Flags UInt32 CODEC(ZSTD(1)),
    Exemplars Nested (
        FilteredAttributes {_MAP},
        TimeUnix DateTime64(9),
        Value Float64,
        SpanId String,
        TraceId String
    ) CODEC(ZSTD(1)),"""

_METRIC_INDEXES = f"""{_ATTRIBUTE_INDEXES},
    INDEX idx_scope_attr_key mapKeys(ScopeAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_scope_attr_value mapValues(ScopeAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_attr_key mapKeys(Attributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_attr_value mapValues(Attributes) TYPE bloom_filter(0.01) GRANULARITY 1"""

_METRIC_LAYOUT = f"""PARTITION BY toDate(TimeUnix)
ORDER BY (ServiceName, MetricName, Attributes, toUnixTimestamp64Nano(TimeUnix))
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1, {_DEDUP}"""


@dataclass(frozen=True)
class Table:
    name: str
    body: str  # columns and indexes
    engine: str  # MergeTree family member, without the Replicated prefix
    layout: str  # PARTITION BY / ORDER BY / SETTINGS
    shard_by: str  # sharding key of the Distributed table in cluster mode


@dataclass(frozen=True)
class View:
    name: str
    target: str
    select: str  # with {source} for the table it reads
    source: str = "otel_traces"  # the table whose inserts it sees


# The spans that carry content, on their way to the views that digest it: a Null table keeps nothing.
_CONTENT_SPANS = "stagetrace_content_spans"
_CONTENT_TYPES = {
    "TraceId": "String",
    "SpanId": "String",
    "ParentSpanId": "String",
    "Timestamp": "DateTime64(9)",
    "Duration": "UInt64",
    "SpanName": "LowCardinality(String)",
    "ServiceName": "LowCardinality(String)",
    "StatusCode": "LowCardinality(String)",
    "ResourceAttributes": _MAP,
    "SpanAttributes": _MAP,
}
_CONTENT_COLUMNS = tuple(_CONTENT_TYPES)


def _content_filter(content: bool) -> str:
    # the content views read the Null table, but also otel_traces itself when a table is refilled (ensure_schema)
    return f"{cv.HAS_CONTENT_SQL} AND " if content else f"NOT {cv.HAS_CONTENT_SQL} AND "


def _requests_select(input_digest: str, output_digest: str, *, content: bool) -> str:
    return f"""SELECT
    {cv.REQUEST_ID_SQL} AS RequestId,
    TraceId,
    SpanId,
    ParentSpanId,
    Timestamp AS Start,
    addNanoseconds(Timestamp, Duration) AS End,
    ServiceName,
    ResourceAttributes['{cv.HOST}'] AS HostName,
    SpanName,
    {input_digest} AS InputDigest,
    {output_digest} AS OutputDigest,
    StatusCode,
    {cv.REQUEST_ID_SOURCE_SQL} AS Source,
    {cv.NONDETERMINISM_SQL} AS Nondeterministic,
    {cv.MODEL_SQL} AS Model
FROM {{source}}
WHERE {_content_filter(content)}{cv.IS_REQUEST_ROOT_SQL}"""


def _stages_select(input_digest: str, output_digest: str, *, content: bool) -> str:
    return f"""SELECT
    TraceId,
    SpanId,
    ParentSpanId,
    SpanName,
    Timestamp AS Start,
    Duration,
    ServiceName,
    ResourceAttributes['{cv.HOST}'] AS HostName,
    {cv.STAGE_SQL} AS Stage,
    {cv.RANK_SQL} AS Rank,
    {input_digest} AS InputDigest,
    {output_digest} AS OutputDigest,
    {cv.STAGE_ATTRIBUTES_SQL} AS Attributes,
    ResourceAttributes,
    {cv.NONDETERMINISM_SQL} AS Nondeterministic
FROM {{source}}
WHERE {_content_filter(content)}Stage != ''"""


TABLES = (
    # The Collector's current span and trace-ID tables (its bloom-filter branch; docs/store.md lists what differs and
    # why): kept apart only where a measurement says so, index granularity 1024 for the lookup (issue 38) and the
    # deduplication window that makes a retried insert land once.
    Table(
        "otel_traces",
        f"""
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes {_MAP} CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes {_MAP} CODEC(ZSTD(1)),
    Duration UInt64 CODEC(T64, ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes {_MAP}
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes {_MAP}
    ) CODEC(ZSTD(1)),
    ResourceAttributeItems Array(String) ALIAS arrayMap(kv -> concat(kv.1, '=', kv.2), CAST(ResourceAttributes, 'Array(Tuple(String, String))')),
    SpanAttributeItems Array(String) ALIAS arrayMap(kv -> concat(kv.1, '=', kv.2), CAST(SpanAttributes, 'Array(Tuple(String, String))')),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,{_ATTRIBUTE_INDEXES},
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1,
    INDEX idx_lower_span_name lower(SpanName) TYPE tokenbf_v1(32768, 3, 0) GRANULARITY 8""",
        "MergeTree()",
        f"""PARTITION BY toDate(Timestamp)
PRIMARY KEY (ServiceName, SpanName, toDateTime(Timestamp))
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp), Timestamp)
SETTINGS index_granularity = {_LOOKUP_GRANULARITY}, ttl_only_drop_parts = 1, {_DEDUP}""",
        "cityHash64(TraceId)",
    ),
    Table(
        "otel_traces_trace_id_ts",
        """
    TraceId String CODEC(ZSTD(1)),
    Start SimpleAggregateFunction(min, DateTime) CODEC(ZSTD(1)),
    End SimpleAggregateFunction(max, DateTime) CODEC(ZSTD(1))""",
        "AggregatingMergeTree()",
        f"""PARTITION BY toStartOfWeek(Start)
ORDER BY (TraceId)
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1, {_DEDUP}""",
        "cityHash64(TraceId)",
    ),
    # The Collector's log table (its newest layout, as its span table's: no TimestampTime column, the time in the key
    # as toDateTime(Timestamp)): an engine's own log lines, joined to the request's trace by TraceId and SpanId.
    Table(
        "otel_logs",
        f"""
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    TraceFlags UInt8,
    SeverityText LowCardinality(String) CODEC(ZSTD(1)),
    SeverityNumber UInt8,
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    Body String CODEC(ZSTD(1)),
    ResourceSchemaUrl LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes {_MAP} CODEC(ZSTD(1)),
    ScopeSchemaUrl LowCardinality(String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion LowCardinality(String) CODEC(ZSTD(1)),
    ScopeAttributes {_MAP} CODEC(ZSTD(1)),
    LogAttributes {_MAP} CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_log_attr_key mapKeys(LogAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_log_attr_value mapValues(LogAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_body Body TYPE tokenbf_v1(32768, 3, 0) GRANULARITY 8""",
        "MergeTree()",
        f"""PARTITION BY toDate(Timestamp)
PRIMARY KEY (ServiceName, toDateTime(Timestamp))
ORDER BY (ServiceName, toDateTime(Timestamp), Timestamp)
SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1, {_DEDUP}""",
        "cityHash64(TraceId)",
    ),
    Table(
        "otel_metrics_gauge",
        f"{_METRIC_COMMON}{_METRIC_INDEXES}",
        "MergeTree()",
        _METRIC_LAYOUT,
        "rand()",
    ),
    Table(
        "otel_metrics_sum",
        f"""{_METRIC_COMMON}
    AggregationTemporality Int32 CODEC(ZSTD(1)),
    IsMonotonic Boolean CODEC(Delta, ZSTD(1)),{_METRIC_INDEXES}""",
        "MergeTree()",
        _METRIC_LAYOUT,
        "rand()",
    ),
    # One row per request root span; small granules because every read is a point lookup.
    Table(
        "stagetrace_requests",
        f"""
    RequestId String CODEC(ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    Start DateTime64(9) CODEC(Delta, ZSTD(1)),
    End DateTime64(9) CODEC(Delta, ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    HostName LowCardinality(String) CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    InputDigest String CODEC(ZSTD(1)),
    OutputDigest String CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    Source LowCardinality(String) CODEC(ZSTD(1)),
    Nondeterministic LowCardinality(String) CODEC(ZSTD(1)),
    Model LowCardinality(String) CODEC(ZSTD(1)),
    PROJECTION {_BY_TRACE} ({_BY_TRACE_SELECT}),
    PROJECTION {_BY_INPUT} ({_BY_INPUT_SELECT})""",
        "MergeTree()",
        f"""PARTITION BY toYYYYMM(Start)
ORDER BY (RequestId, Start)
SETTINGS index_granularity = 2048, {_DEDUP}""",
        "cityHash64(RequestId)",
    ),
    # One row per stage span, narrow columns first: divergence analysis reads stage digests by time
    # without decoding every span's attribute map, and the attributes of one stage without the others.
    Table(
        "stagetrace_stages",
        f"""
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    Start DateTime64(9) CODEC(Delta, ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    HostName LowCardinality(String) CODEC(ZSTD(1)),
    Stage LowCardinality(String) CODEC(ZSTD(1)),
    Rank LowCardinality(String) CODEC(ZSTD(1)),
    InputDigest String CODEC(ZSTD(1)),
    OutputDigest String CODEC(ZSTD(1)),
    Attributes {_MAP} CODEC(ZSTD(1)),
    ResourceAttributes {_MAP} CODEC(ZSTD(1)),
    Nondeterministic LowCardinality(String) CODEC(ZSTD(1))""",
        "MergeTree()",
        f"""PARTITION BY toDate(Start)
ORDER BY (Stage, Start)
SETTINGS index_granularity = {_LOOKUP_GRANULARITY}, {_DEDUP}""",
        "cityHash64(TraceId)",
    ),
    # One row per span below a request's root rows that names a model on its own attributes (few: most requests'
    # roots name it), by trace ID: a request's model where its roots name none (conventions.requests_sql), found by
    # the key for the traces that need it.
    Table(
        "stagetrace_models",
        """
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    Start DateTime64(9) CODEC(Delta, ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    Stage LowCardinality(String) CODEC(ZSTD(1)),
    Model LowCardinality(String) CODEC(ZSTD(1))""",
        "MergeTree()",
        f"""PARTITION BY toDate(Start)
ORDER BY (TraceId, Start)
SETTINGS index_granularity = {_LOOKUP_GRANULARITY}, {_DEDUP}""",
        "cityHash64(TraceId)",
    ),
    Table(
        "stagetrace_divergences",
        """
    DetectedAt DateTime64(3) CODEC(Delta, ZSTD(1)),
    RequestId String CODEC(ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    RequestStart DateTime64(9) CODEC(Delta, ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    HostName LowCardinality(String) CODEC(ZSTD(1)),
    InputDigest String CODEC(ZSTD(1)),
    BaselineRequestId String CODEC(ZSTD(1)),
    BaselineHow LowCardinality(String) CODEC(ZSTD(1)),
    FirstDivergentStage LowCardinality(String) CODEC(ZSTD(1)),
    TopCauseKind LowCardinality(String) CODEC(ZSTD(1)),
    TopCauseName String CODEC(ZSTD(1)),
    TopCauseValue String CODEC(ZSTD(1)),
    TopCauseBaselineValue String CODEC(ZSTD(1)),
    TopCauseScore Float64 CODEC(ZSTD(1)),
    Causes String CODEC(ZSTD(3)),
    Summary String CODEC(ZSTD(1)),
    Devices String CODEC(ZSTD(1)),
    BeganRank String CODEC(ZSTD(1)),
    BeganGpu String CODEC(ZSTD(1)),
    BeganHost String CODEC(ZSTD(1))""",
        "ReplacingMergeTree(DetectedAt)",
        """PARTITION BY toYYYYMM(RequestStart)
ORDER BY (RequestId)""",
        "cityHash64(RequestId)",
    ),
    Table(
        # the live analyser's lease and progress: one row per renewal; the newest row names the holder, until when
        # it holds the lease, and the request start it has analysed through (analysis.live)
        "stagetrace_analyser",
        """
    Holder String CODEC(ZSTD(1)),
    Renewed DateTime64(3) CODEC(Delta, ZSTD(1)),
    Expires DateTime64(3) CODEC(Delta, ZSTD(1)),
    AnalysedUntil DateTime64(9) CODEC(Delta, ZSTD(1))""",
        "MergeTree",
        """ORDER BY Renewed
TTL toDateTime(Renewed) + INTERVAL 7 DAY""",
        "cityHash64(Holder)",
    ),
    # the spans that carry content, passed from otel_traces to the views that digest it (VIEWS); keeps nothing
    Table(
        _CONTENT_SPANS,
        "\n" + ",\n".join(f"    {c} {_CONTENT_TYPES[c]}" for c in _CONTENT_COLUMNS),
        "Null",
        "",
        "",
    ),
    Table(
        "stagetrace_schema_version",
        """
    Version UInt32,
    AppliedAt DateTime DEFAULT now()""",
        "ReplacingMergeTree(AppliedAt)",
        "ORDER BY Version",
        "Version",
    ),
)

VIEWS = (
    View(
        "otel_traces_trace_id_ts_mv",
        "otel_traces_trace_id_ts",
        """SELECT
    TraceId,
    min(toDateTime(Timestamp)) AS Start,
    max(toDateTime(Timestamp)) AS End
FROM {source}
WHERE TraceId != ''
GROUP BY TraceId""",
    ),
    # The rules of the views below live in stagetrace.conventions, so spans written by the Collector are read alike.
    # Each table is filled by two views (issue 32): spans without content, most of them (stagetrace's own spans carry
    # digests), take their digests as the attributes they are; spans with content are passed on to a Null table whose
    # views apply the digest rules. ClickHouse plans a view's query anew for every insert, and the rules' query takes
    # tens of milliseconds to plan, which an insert without content spans now skips (an empty block goes no further).
    View(
        "stagetrace_requests_mv",
        "stagetrace_requests",
        _requests_select(cv.REQUEST_INPUT_DIGEST_GIVEN_SQL, cv.REQUEST_OUTPUT_DIGEST_GIVEN_SQL, content=False),
    ),
    View(
        "stagetrace_stages_mv",
        "stagetrace_stages",
        _stages_select(cv.STAGE_INPUT_DIGEST_GIVEN_SQL, cv.STAGE_OUTPUT_DIGEST_GIVEN_SQL, content=False),
    ),
    View(
        _CONTENT_SPANS + "_mv",
        _CONTENT_SPANS,
        f"SELECT {', '.join(_CONTENT_COLUMNS)}\nFROM {{source}}\nWHERE {cv.HAS_CONTENT_SQL}",
    ),
    View(
        "stagetrace_requests_content_mv",
        "stagetrace_requests",
        _requests_select(cv.REQUEST_INPUT_DIGEST_SQL, cv.REQUEST_OUTPUT_DIGEST_SQL, content=True),
        _CONTENT_SPANS,
    ),
    View(
        "stagetrace_stages_content_mv",
        "stagetrace_stages",
        _stages_select(cv.STAGE_INPUT_DIGEST_SQL, cv.STAGE_OUTPUT_DIGEST_SQL, content=True),
        _CONTENT_SPANS,
    ),
    # the stage rule runs only on the spans that name a model, which the filter keeps
    View(
        "stagetrace_models_mv",
        "stagetrace_models",
        f"""SELECT
    TraceId,
    SpanId,
    Timestamp AS Start,
    ServiceName,
    {cv.STAGE_SQL} AS Stage,
    {cv.OWN_MODEL_SQL} AS Model
FROM {{source}}
WHERE Model != '' AND NOT ({cv.IS_REQUEST_ROOT_SQL})""",
    ),
)

# The Collector's span and log tables as stagetrace reads them, with Map attributes in either of the Collector's
# attribute layouts (stagetrace.attributes): what lookups, the trace dashboards and Grafana's rules read, so that none
# of them depends on how the Collector that made the store was configured. {view: the table it reads}
READ_VIEWS = {"stagetrace_spans": "otel_traces", "stagetrace_logs": "otel_logs"}

# Tables added by a version are filled from the spans already stored when a store is upgraded to it.
BACKFILLS = {2: ("stagetrace_stages_mv",), 18: ("stagetrace_models_mv",)}
# Views whose rules a version changed: dropped, recreated, and their tables refilled from the stored spans.
REBUILDS = {
    4: ("stagetrace_requests_mv", "stagetrace_stages_mv"),
    5: ("stagetrace_requests_mv", "stagetrace_stages_mv"),
    6: ("stagetrace_requests_mv",),
    12: ("stagetrace_requests_mv", "stagetrace_requests_content_mv"),
    13: (
        "stagetrace_requests_mv",
        "stagetrace_requests_content_mv",
        "stagetrace_stages_mv",
        "stagetrace_stages_content_mv",
    ),
    14: (
        "stagetrace_requests_mv",
        "stagetrace_requests_content_mv",
        "stagetrace_stages_mv",
        "stagetrace_stages_content_mv",
    ),
    17: (
        "stagetrace_requests_mv",
        "stagetrace_requests_content_mv",
        "stagetrace_stages_mv",
        "stagetrace_stages_content_mv",
    ),
    19: ("stagetrace_requests_mv", "stagetrace_requests_content_mv", "stagetrace_models_mv"),
}
# Views whose query a version changed without changing the rows they write: dropped and created anew, not refilled.
REPLACED = {11: ("stagetrace_requests_mv", "stagetrace_stages_mv")}
# Columns a version added to tables created before it: {version: ((table, column definition), ...)}.
NEW_COLUMNS = {
    4: (
        ("stagetrace_requests", "Source LowCardinality(String) CODEC(ZSTD(1))"),
        ("stagetrace_stages", "ParentSpanId String CODEC(ZSTD(1)) AFTER SpanId"),
        ("stagetrace_stages", "SpanName LowCardinality(String) CODEC(ZSTD(1)) AFTER ParentSpanId"),
    ),
    5: (
        ("stagetrace_requests", "Nondeterministic LowCardinality(String) CODEC(ZSTD(1))"),
        ("stagetrace_stages", "Nondeterministic LowCardinality(String) CODEC(ZSTD(1))"),
    ),
    7: (("stagetrace_divergences", "Devices String CODEC(ZSTD(1))"),),
    12: (("stagetrace_requests", "Model LowCardinality(String) CODEC(ZSTD(1)) AFTER Nondeterministic"),),
    16: (
        ("stagetrace_divergences", "BeganRank String CODEC(ZSTD(1))"),
        ("stagetrace_divergences", "BeganGpu String CODEC(ZSTD(1))"),
        ("stagetrace_divergences", "BeganHost String CODEC(ZSTD(1))"),
    ),
}

# Projections a version added to tables created before it, built from the rows they hold: {version: ((table,
# projection, its SELECT), ...)}.
NEW_PROJECTIONS = {
    8: (("stagetrace_requests", _BY_TRACE, _BY_TRACE_SELECT),),
    9: (("stagetrace_requests", _BY_INPUT, _BY_INPUT_SELECT),),
}

# Table settings a version changed, applied to tables created before it: {version: (setting, tables)}.
SETTING_CHANGES = {
    3: (
        _DEDUP,
        (
            "otel_traces",
            "otel_traces_trace_id_ts",
            "otel_metrics_gauge",
            "otel_metrics_sum",
            "stagetrace_requests",
            "stagetrace_stages",
        ),
    ),
}

TABLE_NAMES = tuple(t.name for t in TABLES)
VIEW_NAMES = tuple(v.name for v in VIEWS) + tuple(READ_VIEWS)


def _replicated(engine: str) -> str:
    kind, _, args = engine.partition("(")
    args = args.rstrip(")")
    params = "'/clickhouse/tables/{shard}/{database}/{table}', '{replica}'"
    return f"Replicated{kind}({params}{', ' + args if args else ''})"


def statements(
    database: str = "stagetrace",
    cluster: str | None = None,
    *,
    views: bool = True,
    tables: bool = True,
    layouts: dict[str, str] | None = None,
) -> list[str]:
    """Every DDL statement (or only those of the tables, or of the views), in the order it must run.

    With ``cluster``, each table is a ``<name>_local`` Replicated table on every node plus a
    Distributed table under the canonical name, so readers and writers (the Collector included)
    use the same names on one node and on a fleet; materialized views read and write the local tables.
    ``layouts``: the attribute layout of the Collector's tables the views read (``attributes.layouts``; Map where
    not named, as the tables above have it).
    """
    layouts = layouts or {}
    db = identifier(database, "database name")
    on_cluster = f" ON CLUSTER {identifier(cluster, 'cluster name')}" if cluster else ""
    local = "_local" if cluster else ""
    out = [f"CREATE DATABASE IF NOT EXISTS {db}{on_cluster}"] if tables else []
    for table in TABLES if tables else ():
        passing = table.engine == "Null"  # keeps nothing: nothing to replicate or to read through a Distributed table
        engine = _replicated(table.engine) if cluster and not passing else table.engine
        out.append(
            f"CREATE TABLE IF NOT EXISTS {db}.`{table.name}{local}`{on_cluster} ({table.body}\n)"
            f" ENGINE = {engine}\n{table.layout}".rstrip()
        )
        if cluster and not passing:
            out.append(
                f"CREATE TABLE IF NOT EXISTS {db}.`{table.name}`{on_cluster}"
                f" AS {db}.`{table.name}_local`"
                f" ENGINE = Distributed({identifier(cluster)}, {db}, `{table.name}_local`, {table.shard_by})"
            )
    for view in VIEWS if views else ():
        source = read_sql(f"{db}.`{view.source}{local}`", view.source, layouts)
        out.append(
            f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.`{view.name}`{on_cluster}"
            f" TO {db}.`{view.target}{local}`\nAS {view.select.format(source=source)}"
        )
    for name, table in READ_VIEWS.items() if views else ():  # replaced: a table the Collector made anew is read anew
        out.append(
            f"CREATE OR REPLACE VIEW {db}.`{name}`{on_cluster}\n"
            f"AS SELECT * FROM {read_sql(f'{db}.`{table}`', table, layouts)}"
        )
    return out


def read_sql(table_sql: str, table: str, layouts: dict[str, str]) -> str:
    """``table_sql`` (``table``'s rows, ``table`` one of the Collector's) with Map attributes, by its layout."""
    if table not in attributes.COLUMNS:
        return table_sql  # stagetrace's own tables keep Maps
    return attributes.source_sql(table_sql, table, layouts.get(table, attributes.MAP))


# -- which generation of the Collector's tables a store holds: read from the store, not assumed
COLLECTOR_TABLES = ("otel_traces", "otel_traces_trace_id_ts", "otel_metrics_gauge", "otel_metrics_sum", "otel_logs")
CURRENT, PREVIOUS = "the Collector's current layout", "the Collector's previous layout"
_TABLES_SQL = """
SELECT t.name, t.engine, t.sorting_key, c.type
FROM system.tables AS t
LEFT JOIN (SELECT table, type FROM system.columns
           WHERE database = {db:String} AND name = if(table = 'otel_traces_trace_id_ts', 'Start', 'TimeUnix')) AS c
    ON c.table = t.name
WHERE t.database = {db:String}"""


def _generation(table: str, engine: str, sorting_key: str, time_type: str) -> str:
    if table.startswith("otel_metrics_"):  # seconds in the current layout, nanoseconds before
        return CURRENT if time_type == "DateTime" else PREVIOUS
    if table == "otel_traces_trace_id_ts":
        return CURRENT if "Aggregating" in engine else PREVIOUS
    if table == "otel_logs":  # the newest keys on toDateTime(Timestamp); before, on a TimestampTime column
        return PREVIOUS if "TimestampTime" in sorting_key else CURRENT
    return CURRENT if sorting_key.replace(" ", "").endswith(",Timestamp") else PREVIOUS  # otel_traces


JSON_ATTRIBUTES = "JSON attributes"  # said after the generation of a table the Collector made with `json: true`


def check(client, database: str = "stagetrace") -> list[tuple[str, str]]:
    """Each of the store's tables stagetrace reads or keeps, and what it is: which generation of the Collector's
    layout (and, where the Collector stores attributes as JSON, that it does), stagetrace's own, or missing
    (``ensure_schema`` creates what is missing and keeps what is there)."""
    found = {
        name: (engine, key, time_type or "")
        for name, engine, key, time_type in client.query(_TABLES_SQL, parameters={"db": database}).result_rows
    }
    layouts = attributes.layouts(client, database)
    out = []
    for table in TABLE_NAMES + VIEW_NAMES:
        if table not in found:
            out.append((table, "missing"))
        elif table in COLLECTOR_TABLES:
            json = layouts.get(table) == attributes.JSON
            out.append((table, _generation(table, *found[table]) + (f", {JSON_ATTRIBUTES}" if json else "")))
        else:
            owner = "the Collector's" if table.startswith("otel_") else "stagetrace's own"
            out.append((table, owner + (" view" if found[table][0] in ("MaterializedView", "View") else " table")))
    return out


# An embedded store's acknowledged rows rest on its own disk alone: its inserts are fsynced before they return, so
# that a spool segment removed after the insert leaves nothing on an unsynced file (+8% a 4,096-span insert,
# benchmarks/RESULTS.md), and so are the parts its merges write, before the parts merged are removed (a power cut
# must not leave a merged part whose sources are gone half written). The parts a merge replaced stay on disk for
# part_guard.SOURCES_KEPT_S (chdb's default is 0): a merged part the engine committed short when the disk filled is
# undone from them (schema 12). A server store keeps the engine's settings: its operator decides (replicas, its
# own fsync).
DURABLE_TABLES = (
    "otel_traces",
    "otel_traces_trace_id_ts",
    "otel_metrics_gauge",
    "otel_metrics_sum",
    "otel_logs",
    "stagetrace_requests",
    "stagetrace_stages",
    "stagetrace_models",
    "stagetrace_divergences",
    "stagetrace_analyser",
)
DURABLE_SETTINGS = (
    "fsync_after_insert = 1, fsync_part_directory = 1, min_compressed_bytes_to_fsync_after_merge = 1, "
    f"old_parts_lifetime = {SOURCES_KEPT_S}"
)
_NOT_DURABLE_SQL = """
SELECT name FROM system.tables
WHERE database = {db:String} AND name IN {tables:Array(String)}
  AND NOT match(create_table_query, {durable:String})"""


def make_durable(client, database: str = "stagetrace") -> list[str]:
    """Fsync the inserts into the tables the spool writes (those not yet so); the tables changed."""
    changed = [
        r[0]
        for r in client.query(
            _NOT_DURABLE_SQL,
            parameters={
                "db": database,
                "tables": list(DURABLE_TABLES),
                "durable": f"old_parts_lifetime = {SOURCES_KEPT_S}\\b",
            },
        ).result_rows
    ]
    for table in changed:
        client.command(
            f"ALTER TABLE {identifier(database, 'database name')}.`{table}` MODIFY SETTING {DURABLE_SETTINGS}"
        )
    return changed


def installed_version(client, database: str) -> int:
    """The schema version recorded in ``database``, 0 when there is none yet."""
    try:  # one query where the version table exists, as it does for every command but the first
        return int(
            client.command(
                "SELECT max(Version) FROM {db:Identifier}.stagetrace_schema_version", parameters={"db": database}
            )
            or 0
        )
    except Exception:
        exists = client.command(
            "SELECT count() FROM system.tables WHERE database = {db:String} AND name = 'stagetrace_schema_version'",
            parameters={"db": database},
        )
        if int(exists):
            raise  # the table is there: the store failed, and says why
        return 0


def ensure_schema(client, database: str = "stagetrace", cluster: str | None = None) -> bool:
    """Create whatever is missing, fill tables new since the installed version, and record the version.

    Returns True when anything was applied.
    """
    installed = installed_version(client, database)
    if installed >= SCHEMA_VERSION:
        return False
    db = identifier(database, "database name")
    on_cluster = f" ON CLUSTER {identifier(cluster, 'cluster name')}" if cluster else ""
    local = "_local" if cluster else ""
    upgrades = range(installed + 1, SCHEMA_VERSION + 1) if installed else range(0)
    for sql in statements(database, cluster, views=False):
        client.command(sql)
    for version in upgrades:  # before the views are made anew, the columns they write must exist
        for name, column in NEW_COLUMNS.get(version, ()):
            for table in {f"{name}{local}", name}:  # the local table and, on a cluster, its Distributed twin
                client.command(f"ALTER TABLE {db}.`{table}`{on_cluster} ADD COLUMN IF NOT EXISTS {column}")
    for name, projection, select in (p for version in upgrades for p in NEW_PROJECTIONS.get(version, ())):
        table = f"{db}.`{name}{local}`{on_cluster}"
        client.command(f"ALTER TABLE {table} ADD PROJECTION IF NOT EXISTS {projection} ({select})")
        client.command(f"ALTER TABLE {table} MATERIALIZE PROJECTION {projection}")  # the rows stored before it
    for name in (name for version in upgrades for name in REBUILDS.get(version, ()) + REPLACED.get(version, ())):
        client.command(f"DROP VIEW IF EXISTS {db}.`{name}`{on_cluster}")
    # the views read the Collector's tables as they are: Map or JSON attributes (stagetrace.attributes)
    found = attributes.layouts(client, database, [f"{t}{local}" for t in attributes.COLUMNS])
    layouts = {table.removesuffix(local): layout for table, layout in found.items()}
    for sql in statements(database, cluster, tables=False, layouts=layouts):
        client.command(sql)
    views = {v.name: v for v in VIEWS}
    for version in upgrades:
        setting, tables = SETTING_CHANGES.get(version, ("", ()))
        for name in tables:
            client.command(f"ALTER TABLE {db}.`{name}{local}`{on_cluster} MODIFY SETTING {setting}")
    rebuilt = {views[name].target for version in upgrades for name in REBUILDS.get(version, ())}
    # each table is filled once, however many versions it skipped, from every view that writes it (since schema 11,
    # two: spans with content and without), each reading the stored spans
    for target in dict.fromkeys(views[n].target for v in upgrades for n in BACKFILLS.get(v, ()) + REBUILDS.get(v, ())):
        if target in rebuilt:
            client.command(f"TRUNCATE TABLE {db}.`{target}{local}`{on_cluster}")
        for view in (v for v in VIEWS if v.target == target):
            spans = read_sql(f"{db}.`otel_traces`", "otel_traces", layouts)
            client.command(f"INSERT INTO {db}.`{target}` {view.select.format(source=spans)}")
    client.command(
        "INSERT INTO {db:Identifier}.stagetrace_schema_version (Version) VALUES ({v:UInt32})",
        parameters={"db": database, "v": SCHEMA_VERSION},
    )
    return True
