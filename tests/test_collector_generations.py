"""Every generation of the OpenTelemetry Collector's tables: a store whose tables the Collector created is adopted
and read.

``tests/fixtures/collector/current.sql`` is the Collector's current ``clickhouseexporter`` DDL (rendered from its
``internal/sqltemplates``, committed as the Collector renders it): metric tables with ``DateTime`` (seconds)
times, ``LowCardinality`` metric names and another sort key, the trace-ID table on ``AggregatingMergeTree``,
``otel_traces`` with ``Timestamp`` in its sort key. ``previous.sql`` is its previous layout (bloom filters only,
``DateTime64(9)`` metric times, the trace-ID table on ``MergeTree``), which stores made by older Collectors and older
stagetrace releases have. The tests create one generation's tables first, as a fleet shipping through the Collector
has them, let stagetrace adopt the store, write spans with stagetrace's writer and samples with a plain ``INSERT``
as the Collector writes them, and run the analysis on it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import stagetrace
from stagetrace import lookup
from stagetrace.analysis import divergences
from stagetrace.analysis.explain import Explainer
from stagetrace.store import open_store
from stagetrace.tracing import PIPELINE_STAGES

GENERATIONS = ("current", "previous")
PROMPT = {"prompt": "why is the sky blue?", "seed": 7}


def collector_statements(generation: str = "current") -> list[str]:
    """The generation's DDL statements (separated by lines holding only ``;;``), comments left out; ``json``: the
    Collector's JSON attribute layout (``fixtures/collector_json``)."""
    fixtures = Path(__file__).with_name("fixtures")
    ddl = (
        fixtures / "collector_json" / "json.sql"
        if generation == "json"
        else fixtures / "collector" / f"{generation}.sql"
    )
    chunks = re.split(r"^;;$", ddl.read_text(), flags=re.M)
    statements = [
        "\n".join(line for line in chunk.splitlines() if not line.startswith("--")).strip() for chunk in chunks
    ]
    return [s for s in statements if s]


def adopted(store_dsn: str, generation: str):
    """A store whose span, trace-ID and metric tables the Collector of ``generation`` created, opened by stagetrace
    (which adopts it: its own tables and views beside the Collector's)."""
    with open_store(store_dsn, create_schema=False) as bare:
        bare.client.command("CREATE DATABASE IF NOT EXISTS stagetrace")
        for statement in collector_statements(generation):
            bare.client.command(statement)
    return open_store(store_dsn)


@pytest.fixture
def current_store(store_dsn):
    with adopted(store_dsn, "current") as store:
        yield store


@pytest.fixture(params=GENERATIONS)
def collector_store(request, store_dsn):
    with adopted(store_dsn, request.param) as store:
        yield store


def column_type(store, table: str, column: str) -> str:
    return store.client.command(
        "SELECT type FROM system.columns WHERE database = {db:String} AND table = {t:String} AND name = {c:String}",
        parameters={"db": store.database, "t": table, "c": column},
    )


def record(request_id: str, deviate: bool = False, gpu: str = "GPU-a") -> None:
    """A five-stage request on node-a; a deviating one differs from decode on."""
    with stagetrace.request(request_id, input=PROMPT) as req:
        data = PROMPT["prompt"]
        for name in PIPELINE_STAGES:
            with stagetrace.stage(name, input=data, attributes={"gpu.uuid": gpu} if name == "decode" else {}) as st:
                data = f"{name}({data})" + ("*" if deviate and name == "decode" else "")
                st.set_output(data)
        req.set_output(data)
    stagetrace.flush()


def collector_sample(store, name: str, labels: dict, value: float) -> None:
    """One counter sample as the Collector inserts it: its own columns, times in whole seconds."""
    store.client.command(
        "INSERT INTO {db:Identifier}.otel_metrics_sum (ResourceAttributes, ServiceName, MetricName, Attributes, "
        "StartTimeUnix, TimeUnix, Value, AggregationTemporality, IsMonotonic) "
        "VALUES (map('host.name', 'node-a'), 'stagetrace-agent', {n:String}, "
        "mapFromArrays({lk:Array(String)}, {lv:Array(String)}), now() - 1000, now(), {v:Float64}, 2, true)",
        parameters={"db": store.database, "n": name, "lk": list(labels), "lv": list(labels.values()), "v": value},
    )


def test_the_collectors_current_tables_are_adopted_as_they_are(current_store):
    """stagetrace adds its own tables and views beside the Collector's, changes none of them, and says which
    generation each is."""
    from stagetrace import schema

    assert column_type(current_store, "otel_metrics_sum", "TimeUnix") == "DateTime"
    assert column_type(current_store, "otel_metrics_gauge", "MetricName") == "LowCardinality(String)"
    assert column_type(current_store, "otel_traces_trace_id_ts", "Start") == "SimpleAggregateFunction(min, DateTime)"
    tables = {
        r[0]
        for r in current_store.client.query(
            "SELECT name FROM system.tables WHERE database = {db:String}", parameters={"db": current_store.database}
        ).result_rows
    }
    assert {"stagetrace_requests", "stagetrace_stages", "stagetrace_divergences"} <= tables
    states = dict(schema.check(current_store.client, current_store.database))
    assert {t: states[t] for t in schema.COLLECTOR_TABLES} == {t: schema.CURRENT for t in schema.COLLECTOR_TABLES}
    assert states["stagetrace_requests"] == "stagetrace's own table" and "missing" not in states.values()


def test_the_collectors_previous_tables_are_adopted_as_they_are(store_dsn):
    from stagetrace import schema

    with adopted(store_dsn, "previous") as store:
        assert column_type(store, "otel_metrics_sum", "TimeUnix") == "DateTime64(9)"
        states = dict(schema.check(store.client, store.database))
    assert {t: states[t] for t in schema.COLLECTOR_TABLES} == {t: schema.PREVIOUS for t in schema.COLLECTOR_TABLES}


def test_a_store_stagetrace_creates_has_the_current_span_tables_and_nanosecond_samples(store):
    """New stores get the Collector's current span and trace-ID tables; the metric tables keep nanosecond sample
    times on purpose (docs/store.md), which is the previous layout's time type."""
    from stagetrace import schema

    states = dict(schema.check(store.client, store.database))
    assert [states[t] for t in ("otel_traces", "otel_traces_trace_id_ts", "otel_logs")] == [schema.CURRENT] * 3
    assert column_type(store, "otel_traces", "Duration") == "UInt64"
    assert column_type(store, "otel_metrics_gauge", "TimeUnix") == "DateTime64(9)"
    store.client.command("DROP TABLE stagetrace.stagetrace_divergences")
    assert dict(schema.check(store.client, store.database))["stagetrace_divergences"] == "missing"


def test_trace_explain_and_divergences_read_each_generation(collector_store):
    """An XID on the request's GPU, in samples with whole-second times: `explain` names it from the metric tables,
    `divergences` finds the request and reads the same samples, the lookup finds its trace through the Collector's
    trace-ID table."""
    stagetrace.configure(store=collector_store, host_name="node-a", service_name="rag")
    gpu = {"gpu": "0", "uuid": "GPU-a", "model": "H200"}
    collector_sample(collector_store, "gpu_energy_joules_total", gpu, 1)  # a scrape
    for i in range(3):
        record(f"ok-{i}")
    time.sleep(1.1)  # samples are whole seconds here: the next scrape lands after the agreeing requests
    collector_sample(collector_store, "gpu_energy_joules_total", gpu, 2)
    collector_sample(collector_store, "gpu_xid_errors_total", {**gpu, "xid": "48"}, 1)  # born at its first event
    time.sleep(1.1)
    record("odd", deviate=True)
    time.sleep(1.1)
    collector_sample(collector_store, "gpu_energy_joules_total", gpu, 3)
    collector_sample(collector_store, "gpu_xid_errors_total", {**gpu, "xid": "48"}, 1)

    trace = lookup.by_request_id(collector_store, "odd")
    assert len(trace.spans) == 6 and lookup.by_trace_id(collector_store, trace.trace_id).request_id == "odd"
    report = Explainer(collector_store).explain("odd").to_json()
    assert report["first_divergent_stage"] == "decode", report["summary"]
    top = report["causes"][0]
    assert (top["kind"], top["name"], top["device"], top["value"]) == (
        "hardware",
        "gpu_xid_errors_total",
        "GPU-a",
        "+1",
    )
    found = divergences.find(collector_store, 3600 * 10**9)
    (item,) = [i for g in found["groups"] for i in g["deviating"]]
    assert item["request_id"] == "odd" and item["first_divergent_stage"] == "decode"
    assert "gpu_xid_errors_total" in item["summary"]  # read from the metric tables here too


# The Grafana plugin's "View logs" on a trace (src/data/utils.ts: a logs query with the OTel log columns and a TraceId
# filter, rendered by src/data/sqlGenerator.ts), as it builds it, and as newer releases do with the time range
# filter on Timestamp (the OTel 1.3.0 map; its 1.2.9 map filters on TimestampTime, which the newest table lacks).
PLUGIN_VIEW_LOGS_SQL = (
    """SELECT Timestamp as "timestamp", Body as "body", SeverityText as "level", LogAttributes as "labels", """
    """TraceId as "traceID" FROM "stagetrace"."otel_logs" WHERE ( traceID = '{trace_id}' ) """
    """ORDER BY timestamp ASC LIMIT 1000""",
    """SELECT Timestamp as "timestamp", Body as "body", SeverityText as "level", LogAttributes as "labels", """
    """TraceId as "traceID" FROM "stagetrace"."otel_logs" WHERE ( Timestamp >= toDateTime({start}) AND """
    """Timestamp <= toDateTime({end}) ) AND ( traceID = '{trace_id}' ) ORDER BY timestamp ASC LIMIT 1000""",
)


# The plugin's trace-ID query when the trace-ID table exists (src/data/sqlGenerator.ts, as its own tests expect it).
PLUGIN_TRACE_SQL = (
    """WITH '{trace_id}' as trace_id, (SELECT min(Start) FROM "stagetrace"."otel_traces_trace_id_ts" WHERE TraceId = """
    """trace_id) as trace_start, (SELECT max(End) + 1 FROM "stagetrace"."otel_traces_trace_id_ts" WHERE TraceId = """
    """trace_id) as trace_end SELECT "TraceId" as traceID, "SpanId" as spanID, "ParentSpanId" as parentSpanID, """
    """"ServiceName" as serviceName, "SpanName" as operationName, multiply(toUnixTimestamp64Nano("Timestamp"), """
    """0.000001) as startTime, multiply("Duration", 0.000001) as duration, arrayMap(key -> map('key', key, 'value',"""
    """"SpanAttributes"[key]), mapKeys("SpanAttributes")) as tags, arrayMap(key -> map('key', key, 'value',"""
    """"ResourceAttributes"[key]), mapKeys("ResourceAttributes")) as serviceTags, if("StatusCode" IN ('Error', """
    """'STATUS_CODE_ERROR'), 2, 0) as statusCode FROM "stagetrace"."otel_traces" WHERE traceID = trace_id AND """
    """"Timestamp" >= trace_start AND "Timestamp" <= trace_end LIMIT 1000"""
)


def test_logs_land_and_are_read_on_each_generation(collector_store):
    """A log line written by stagetrace's receiver path and one the Collector inserts, in the request's trace:
    `trace` reads both, and so does the Grafana plugin's "View logs" query, on each generation's log table; the
    plugin's trace query finds the trace's spans through each generation's trace-ID table."""
    from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
    from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs

    from stagetrace.exporters.durable import DurableWriter
    from stagetrace.exporters.otlp import LOG_COLUMNS, LOGS_TABLE, log_rows

    stagetrace.configure(store=collector_store, host_name="node-a", service_name="rag")
    record("logged")
    trace = lookup.by_request_id(collector_store, "logged")
    decode = next(s for s in trace.spans if s.stage_name == "decode")
    sent = ExportLogsServiceRequest(
        resource_logs=[
            ResourceLogs(
                scope_logs=[
                    ScopeLogs(
                        log_records=[
                            LogRecord(
                                time_unix_nano=decode.start_ns,
                                severity_text="WARN",
                                severity_number=13,
                                trace_id=bytes.fromhex(trace.trace_id),
                                span_id=bytes.fromhex(decode.span_id),
                            )
                        ]
                    )
                ]
            )
        ]
    )
    sent.resource_logs[0].scope_logs[0].log_records[0].body.string_value = "preempted: KV cache full"
    writer = DurableWriter(collector_store, "logs", spool_dir=False)
    assert writer.write(LOGS_TABLE, LOG_COLUMNS, log_rows(sent))
    writer.close()
    collector_store.client.command(  # the Collector's own insert: its columns, the time as it came
        "INSERT INTO {db:Identifier}.otel_logs (Timestamp, TraceId, SpanId, SeverityText, SeverityNumber, ServiceName, "
        "Body) VALUES (fromUnixTimestamp64Nano({t:Int64}), {tid:String}, {sid:String}, 'ERROR', 17, 'vllm', "
        "'CUDA graph replay fell back to eager mode')",
        parameters={
            "db": collector_store.database,
            "t": decode.start_ns + 1000,
            "tid": trace.trace_id,
            "sid": decode.span_id,
        },
    )
    lines = lookup.logs_of(collector_store, trace)
    assert [(line.severity, line.body) for line in lines] == [
        ("WARN", "preempted: KV cache full"),
        ("ERROR", "CUDA graph replay fell back to eager mode"),
    ]
    spans = collector_store.client.query(PLUGIN_TRACE_SQL.format(trace_id=trace.trace_id)).result_rows
    assert sorted(r[1] for r in spans) == sorted(s.span_id for s in trace.spans)
    start, end = trace.start_ns // 10**9 - 60, trace.start_ns // 10**9 + 60
    for sql in PLUGIN_VIEW_LOGS_SQL:
        rows = collector_store.client.query(sql.format(trace_id=trace.trace_id, start=start, end=end)).result_rows
        assert [(r[1], r[2], r[4]) for r in rows] == [
            ("preempted: KV cache full", "WARN", trace.trace_id),
            ("CUDA graph replay fell back to eager mode", "ERROR", trace.trace_id),
        ], sql


def test_schema_check_prints_each_tables_generation(store_dsn, capsys):
    from stagetrace.cli import main

    assert main(["schema", "--store", store_dsn]) == 0
    capsys.readouterr()
    assert main(["schema", "--check", "--store", store_dsn]) == 0
    lines = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    assert lines["otel_traces"] == "the Collector's current layout"
    assert lines["otel_metrics_sum"] == "the Collector's previous layout"  # nanosecond sample times, on purpose
    assert lines["stagetrace_stages_mv"] == "stagetrace's own view"
