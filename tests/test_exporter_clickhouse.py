"""ClickHouseSpanExporter against the real embedded ClickHouse engine, under the SDK's own processors."""

import time

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
            self.calls.append(len(data))
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
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes={"n": 3, "ok": True, "ids": [1, 2]}) as root:
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
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces_trace_id_ts WHERE TraceId = {t:String}",
                                parameters={"t": root_row["TraceId"]}) >= 1  # fmt: skip
    provider.shutdown()


def test_small_sdk_batches_are_coalesced_into_few_inserts(store):
    counter = CountingInserts(store.client)
    exporter = ClickHouseSpanExporter(store=store, max_batch_rows=5000, max_delay_s=30)
    provider = _provider(exporter, max_queue_size=4096, max_export_batch_size=100, schedule_delay_millis=5)  # no SDK drops
    tracer = provider.get_tracer("t")
    for i in range(2500):
        tracer.start_span(f"s{i % 7}").end()
    assert provider.force_flush()
    assert exporter.force_flush()  # the SDK's force_flush does not reach the exporter's buffer
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 2500
    assert sum(counter.calls) == 2500 and len(counter.calls) <= 2, counter.calls
    provider.shutdown()


def test_a_full_batch_is_written_without_waiting_for_the_delay(store):
    counter = CountingInserts(store.client)
    exporter = ClickHouseSpanExporter(store=store, max_batch_rows=300, max_delay_s=3600)
    provider = _provider(exporter, max_export_batch_size=100, schedule_delay_millis=5)
    tracer = provider.get_tracer("t")
    for _ in range(600):
        tracer.start_span("s").end()
    provider.force_flush()
    deadline = time.monotonic() + 10
    while sum(counter.calls) < 600 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counter.calls == [300, 300]
    provider.shutdown()


def test_shutdown_writes_what_is_held_and_refuses_more(store):
    exporter = ClickHouseSpanExporter(store=store, max_delay_s=3600)
    provider = _provider(exporter)
    tracer = provider.get_tracer("t")
    for _ in range(10):
        tracer.start_span("s").end()
    provider.shutdown()  # BatchSpanProcessor.shutdown → exporter.shutdown
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 10
    assert exporter.export([]) is SpanExportResult.FAILURE


def test_rows_survive_a_failing_store_and_land_once_it_recovers(store):
    """A real insert failure: the table is renamed away, then back."""
    exporter = ClickHouseSpanExporter(store=store, max_delay_s=0.05)
    provider = _provider(exporter, SimpleSpanProcessor)
    tracer = provider.get_tracer("t")
    store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.otel_traces_away")
    for _ in range(20):
        tracer.start_span("during-outage").end()
    assert exporter.force_flush(timeout_millis=300) is False  # not in the store yet, and it says so
    store.client.command("RENAME TABLE stagetrace.otel_traces_away TO stagetrace.otel_traces")
    assert exporter.force_flush(timeout_millis=10_000) is True
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces WHERE SpanName = 'during-outage'") == 20
    provider.shutdown()


def test_when_the_buffer_is_full_spans_are_dropped_and_counted(store, caplog):
    # without a spool: with one, failed batches move to disk and the buffer does not fill
    exporter = ClickHouseSpanExporter(store=store, max_delay_s=0.01, max_buffered_rows=5, spool_dir=False)
    provider = _provider(exporter, SimpleSpanProcessor)
    tracer = provider.get_tracer("t")
    store.client.command("RENAME TABLE stagetrace.otel_traces TO stagetrace.otel_traces_away")
    for _ in range(8):
        tracer.start_span("s").end()
    assert exporter.dropped_spans == 3
    assert "dropping 1 spans" in caplog.text
    store.client.command("RENAME TABLE stagetrace.otel_traces_away TO stagetrace.otel_traces")
    provider.shutdown()
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 5


@pytest.mark.parametrize("value, stored", [
    ("x", "x"), (True, "true"), (7, "7"), (0.5, "0.5"), (["a", "b"], '["a","b"]'), ((1.5, 2.0), "[1.5,2.0]"),
])  # fmt: skip
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

    from stagetrace.exporters.clickhouse import _Resources, span_row

    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    live = provider.get_tracer("t").start_span("s", attributes={"a": 1, "b": ["x"]})
    live.add_event("ev", {"k": True}, timestamp=5)
    live.end(end_time=live.start_time + 10)
    plain = ReadableSpan(
        "s", context=live.context, resource=live.resource, attributes={"a": 1, "b": ("x",)},
        events=(Event("ev", {"k": True}, timestamp=5),), start_time=live.start_time, end_time=live.end_time,
        instrumentation_scope=live.instrumentation_scope, kind=live.kind, status=live.status,
    )  # fmt: skip
    assert span_row(live, _Resources()) == span_row(plain, _Resources())
