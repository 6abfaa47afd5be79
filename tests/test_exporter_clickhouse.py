"""ClickHouseSpanExporter against the real embedded ClickHouse engine, under the SDK's own processors."""

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from stagetrace.exporters.clickhouse import ClickHouseSpanExporter


class CountingInserts:
    """Counts the real inserts the exporter makes (each still goes to ClickHouse)."""

    def __init__(self, client):
        self.calls = []
        self._insert = client.insert

        def insert(table, data, **kwargs):
            self.calls.append(len(data[0]) if kwargs.get("column_oriented") else len(data))  # rows, as rows or columns
            return self._insert(table, data, **kwargs)

        client.insert = insert


def _provider(exporter, processor=BatchSpanProcessor, **kwargs):
    provider = TracerProvider(resource=Resource.create({"service.name": "svc", "host.name": "node-a"}))
    provider.add_span_processor(processor(exporter, **kwargs))
    return provider


def test_spans_land_with_the_collector_column_values(store):
    exporter = ClickHouseSpanExporter(store=store)
    provider = _provider(exporter, SimpleSpanProcessor)
    tracer = provider.get_tracer("test-scope", "1.2")
    with tracer.start_as_current_span(
        "root", kind=SpanKind.SERVER, attributes={"n": 3, "ok": True, "ids": [1, 2]}
    ) as root:
        root.add_event("tokenized", {"tokens": 17})
        with tracer.start_as_current_span("child", links=[Link(root.get_span_context(), {"why": "retry"})]) as child:
            child.set_status(Status(StatusCode.ERROR, "boom"))
    assert exporter.force_flush()
    rows = {r["SpanName"]: r for r in store.client.query("SELECT * FROM stagetrace.otel_traces").named_results()}
    root_row, child_row = rows["root"], rows["child"]
    assert root_row["SpanKind"] == "Server" and child_row["SpanKind"] == "Internal"
    assert root_row["ServiceName"] == "svc" and root_row["ResourceAttributes"]["host.name"] == "node-a"
    assert (root_row["ScopeName"], root_row["ScopeVersion"]) == ("test-scope", "1.2")
    assert root_row["SpanAttributes"] == {"n": "3", "ok": "true", "ids": "[1,2]"}
    assert root_row["ParentSpanId"] == "" and child_row["ParentSpanId"] == root_row["SpanId"]
    assert len(root_row["TraceId"]) == 32 and child_row["TraceId"] == root_row["TraceId"]
    assert (child_row["StatusCode"], child_row["StatusMessage"]) == ("Error", "boom")
    assert root_row["StatusCode"] == "Unset"
    assert root_row["Events.Name"] == ["tokenized"] and root_row["Events.Attributes"] == [{"tokens": "17"}]
    assert child_row["Links.SpanId"] == [root_row["SpanId"]] and child_row["Links.Attributes"] == [{"why": "retry"}]
    assert 0 < child_row["Duration"] <= root_row["Duration"]
    # the materialized view keeps the trace-ID lookup table current
    assert (
        store.client.command(
            "SELECT count() FROM stagetrace.otel_traces_trace_id_ts WHERE TraceId = {t:String}",
            parameters={"t": root_row["TraceId"]},
        )
        >= 1
    )
    provider.shutdown()


def test_success_means_the_spans_are_already_in_the_store(store):
    """An acknowledgement is a promise: no flush is needed between SUCCESS and a query."""
    counter = CountingInserts(store.client)
    exporter = ClickHouseSpanExporter(store=store)
    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    spans = []
    for i in range(300):
        span = provider.get_tracer("t").start_span(f"s{i % 7}")
        span.end()
        spans.append(span)
    assert exporter.export(spans[:200]) is SpanExportResult.SUCCESS
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 200
    assert exporter.export(spans[200:]) is SpanExportResult.SUCCESS
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 300
    assert counter.calls == [200, 100]  # one insert per batch: the SDK's batch size decides (configure: 4,096)
    exporter.shutdown()


def test_shutdown_closes_and_refuses_more(store):
    exporter = ClickHouseSpanExporter(store=store)
    provider = _provider(exporter)
    tracer = provider.get_tracer("t")
    for _ in range(10):
        tracer.start_span("s").end()
    provider.shutdown()  # BatchSpanProcessor.shutdown → exporter.shutdown
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 10
    assert exporter.export([]) is SpanExportResult.FAILURE


def test_spans_spooled_through_a_failing_store_land_once_it_recovers(store):
    """A real insert failure: the table is renamed away, then back."""
    exporter = ClickHouseSpanExporter(store=store)
    provider = _provider(exporter, SimpleSpanProcessor)
    tracer = provider.get_tracer("t")
    store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.otel_traces_away")
    for _ in range(20):
        tracer.start_span("during-outage").end()  # SUCCESS each time: fsynced in the spool
    assert exporter.spool.rows() == 20 and exporter.refused_spans == 0
    assert exporter.force_flush(timeout_millis=300) is False  # not in the store yet, and it says so
    store.client.command("RENAME TABLE stagetrace.otel_traces_away TO stagetrace.otel_traces")
    assert exporter.force_flush(timeout_millis=10_000) is True
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces WHERE SpanName = 'during-outage'") == 20
    provider.shutdown()


def test_without_a_spool_a_failing_store_is_answered_failure_and_nothing_is_kept(store, caplog):
    exporter = ClickHouseSpanExporter(store=store, spool_dir=False)
    spans = []
    for _ in range(8):
        span = TracerProvider().get_tracer("t").start_span("s")
        span.end()
        spans.append(span)
    store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.otel_traces_away")
    assert exporter.export(spans[:3]) is SpanExportResult.FAILURE  # the SDK counts them as dropped
    assert exporter.refused_spans == 3 and "3 spans could not be stored" in caplog.text
    store.client.command("RENAME TABLE stagetrace.otel_traces_away TO stagetrace.otel_traces")
    assert exporter.export(spans[3:]) is SpanExportResult.SUCCESS
    exporter.shutdown()
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 5


def test_a_span_with_float_times_is_stored_with_integer_nanoseconds(store):
    """The SDK takes any number for start and end times and does not check; the row needs integers."""
    exporter = ClickHouseSpanExporter(store=store)
    span = TracerProvider().get_tracer("t").start_span("floaty", start_time=1.7e18)
    span.end(end_time=1.7e18 + 2560.0)  # floats this large step by 256 ns
    assert exporter.export([span]) is SpanExportResult.SUCCESS
    assert store.client.query(
        "SELECT toUnixTimestamp64Nano(Timestamp), Duration FROM stagetrace.otel_traces WHERE SpanName = 'floaty'"
    ).result_rows == [(1_700_000_000_000_000_000, 2560)]
    exporter.shutdown()


@pytest.mark.parametrize(
    "value, stored",
    [
        ("x", "x"),
        (True, "true"),
        (7, "7"),
        (0.5, "0.5"),
        (["a", "b"], '["a","b"]'),
        ((1.5, 2.0), "[1.5,2.0]"),
    ],
)
def test_attribute_values_of_every_otel_type(store, value, stored):
    exporter = ClickHouseSpanExporter(store=store)
    provider = _provider(exporter, SimpleSpanProcessor)
    provider.get_tracer("t").start_span("s", attributes={"k": value}).end()
    exporter.force_flush()
    assert store.client.query("SELECT SpanAttributes['k'] FROM stagetrace.otel_traces").result_rows == [(stored,)]
    provider.shutdown()


def test_rows_from_sdk_spans_and_from_plain_readable_spans_agree():
    """The exporter reads the SDK's containers directly when it can; a bare ReadableSpan takes the public path."""
    from opentelemetry.sdk.trace import Event, ReadableSpan

    from stagetrace.exporters.rows import Resources, span_row

    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    live = provider.get_tracer("t").start_span("s", attributes={"a": 1, "b": ["x"]})
    live.add_event("ev", {"k": True}, timestamp=5)
    live.end(end_time=live.start_time + 10)
    plain = ReadableSpan(
        "s",
        context=live.context,
        resource=live.resource,
        attributes={"a": 1, "b": ("x",)},
        events=(Event("ev", {"k": True}, timestamp=5),),
        start_time=live.start_time,
        end_time=live.end_time,
        instrumentation_scope=live.instrumentation_scope,
        kind=live.kind,
        status=live.status,
    )
    assert span_row(live, Resources()) == span_row(plain, Resources())

    class PublicOnly:  # another SDK's span: only ReadableSpan's public properties
        def __init__(self, span):
            self._span = span

        def __getattr__(self, name):
            if name.startswith("_"):
                raise AttributeError(name)
            return getattr(self._span, name)

    assert span_row(PublicOnly(live), Resources()) == span_row(live, Resources())


def test_rows_keep_links_trace_state_and_parent_on_both_paths():
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import Link, SpanContext, TraceFlags, TraceState

    from stagetrace.exporters.rows import COLUMNS, Resources, span_row

    state = TraceState([("vendor", "v1")])
    parent = SpanContext(0xAB, 0xCD, is_remote=True, trace_flags=TraceFlags(1), trace_state=state)
    own = SpanContext(0xAB, 0xEF, is_remote=False, trace_flags=TraceFlags(1), trace_state=state)
    span = ReadableSpan(
        "s", context=own, parent=parent, links=(Link(parent, {"why": "retry"}),), start_time=100, end_time=90
    )
    row = dict(zip(COLUMNS, span_row(span, Resources())))
    assert (row["TraceId"], row["SpanId"], row["ParentSpanId"]) == (f"{0xAB:032x}", f"{0xEF:016x}", f"{0xCD:016x}")
    assert row["TraceState"] == "vendor=v1" and row["Links.TraceState"] == ["vendor=v1"]
    assert row["Links.SpanId"] == [f"{0xCD:016x}"] and row["Links.Attributes"] == [{"why": "retry"}]
    assert row["Duration"] == 0  # an end before the start is no negative duration
