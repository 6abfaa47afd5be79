"""The OTLP/HTTP receiver against the real embedded store, fed by the official OTLP exporters and raw requests."""

import base64
import gzip
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from stagetrace.exporters.clickhouse import COLUMNS, ClickHouseSpanExporter
from stagetrace.exporters.otlp import OtlpReceiver

# every span these tests store is also the corpus of the views' rows (tests/views_reference.py)
pytestmark = pytest.mark.views_row_for_row

VLLM = Path(__file__).parent / "fixtures" / "vllm" / "llm_request.json"


@pytest.fixture
def receiver(store):
    r = OtlpReceiver(store, "127.0.0.1:0")
    yield r
    r.close()


def post(url: str, body: bytes, content_type: str, **headers) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type, **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def recorded_spans() -> list:
    """Spans from the plain SDK covering every column: kinds, status, events, links, attribute types, tracestate."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "rag-api", "host.name": "node-a"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("app.scope", "2.1")
    attributes = {"s": "x", "i": 7, "f": 0.25, "b": False, "ints": [1, 2], "strs": ["a", "b"], "floats": [0.5, 1.0]}
    with tracer.start_as_current_span(
        "root", kind=SpanKind.SERVER, attributes={"stagetrace.request.id": "r-1", **attributes}
    ) as root:
        root.add_event("tokenized", {"tokens": 17, "ok": True})
        for kind in (SpanKind.CLIENT, SpanKind.PRODUCER, SpanKind.CONSUMER, SpanKind.INTERNAL):
            with tracer.start_as_current_span(
                f"child-{kind.name}", kind=kind, links=[Link(root.get_span_context(), {"why": "retry"})]
            ) as child:
                child.set_status(Status(StatusCode.ERROR, "boom") if kind is SpanKind.CLIENT else Status(StatusCode.OK))
    provider.shutdown()
    return list(memory.get_finished_spans())


def rows_by_span(store) -> dict[str, list[tuple]]:
    columns = ", ".join(f"`{c}`" for c in COLUMNS)
    rows: dict[str, list[tuple]] = {}
    for row in store.client.query(f"SELECT {columns} FROM stagetrace.otel_traces").result_rows:
        rows.setdefault(row[COLUMNS.index("SpanId")], []).append(row)
    return rows


def test_spans_over_otlp_get_exactly_the_columns_the_python_exporter_writes(store, receiver):
    spans = recorded_spans()
    direct = ClickHouseSpanExporter(store=store, create_schema=False)
    assert direct.export(spans) is SpanExportResult.SUCCESS and direct.force_flush()
    assert OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces").export(spans) is SpanExportResult.SUCCESS
    assert receiver.writer.flush()
    rows = rows_by_span(store)
    assert len(rows) == len(spans) == 5
    for span_id, (first, second) in rows.items():
        assert first == second, span_id
    root = next(r[0] for r in rows.values() if r[0][COLUMNS.index("SpanName")] == "root")
    assert root[COLUMNS.index("SpanAttributes")]["floats"] == "[0.5,1.0]"
    direct.shutdown()


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip, Compression.Deflate])
def test_the_sdk_exporter_with_each_compression(store, receiver, compression):
    provider = TracerProvider(resource=Resource.create({"service.name": "svc"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(f"{receiver.url}/v1/traces", compression=compression))
    )
    with provider.get_tracer("t").start_as_current_span(
        "request", attributes={"stagetrace.request.id": f"c-{compression.value}"}
    ):
        pass
    provider.shutdown()
    assert receiver.writer.flush()
    assert store.client.command("SELECT RequestId FROM stagetrace.stagetrace_requests") == f"c-{compression.value}"


def test_a_200_means_the_spans_are_durable_and_a_retried_body_is_stored_once(store, receiver):
    exporter = OTLPSpanExporter(f"{receiver.url}/v1/traces")
    for expected in (5, 10):
        assert exporter.export(recorded_spans()) is SpanExportResult.SUCCESS
        # answered: in the store, or fsynced in the spool waiting for the replay thread's insert (a group inserted and
        # not yet retired is in both for a moment: counted twice, never missing)
        stored = store.client.command("SELECT count() FROM stagetrace.otel_traces")
        assert stored <= expected <= stored + receiver.writer.spooled_rows()
    assert receiver.writer.flush() and store.client.command("SELECT count() FROM stagetrace.otel_traces") == 10
    body = _vllm_protobuf()
    # a sender retrying a request whose answer it lost: while it waits in the spool, and after it is stored
    for flush in (False, False, True, False):
        assert post(f"{receiver.url}/v1/traces", body, "application/x-protobuf")[0] == 200
        assert not flush or receiver.writer.flush()
    assert receiver.writer.flush() and store.client.command("SELECT count() FROM stagetrace.otel_traces") == 11


def test_a_receiver_on_the_same_store_recognises_requests_an_earlier_one_stored(store):
    body = _vllm_protobuf()
    first = OtlpReceiver(store, "127.0.0.1:0")
    assert post(f"{first.url}/v1/traces", body, "application/x-protobuf")[0] == 200
    first.close()  # stores what it wrote ahead
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 1
    second = OtlpReceiver(store, "127.0.0.1:0")  # as an agent restarted after it was killed before answering
    try:
        assert post(f"{second.url}/v1/traces", body, "application/x-protobuf")[0] == 200
        assert second.writer.flush() and store.client.command("SELECT count() FROM stagetrace.otel_traces") == 1
    finally:
        second.close()


def test_otlp_json_with_hex_ids_and_a_partial_success_for_invalid_ids(store, receiver):
    document = json.loads(VLLM.read_text())
    spans = document["resourceSpans"][0]["scopeSpans"][0]["spans"]
    spans += [dict(spans[0], spanId="zz" * 8), dict(spans[0], traceId="00" * 16), dict(spans[0], spanId="abcd")]
    status, headers, body = post(f"{receiver.url}/v1/traces", json.dumps(document).encode(), "application/json")
    assert (status, headers["Content-Type"]) == (200, "application/json")
    answer = json.loads(body)["partialSuccess"]
    assert int(answer["rejectedSpans"]) == 3 and "invalid trace or span ID" in answer["errorMessage"]
    assert receiver.writer.flush()
    (row,) = store.client.query(
        "SELECT TraceId, SpanId, SpanKind, ServiceName, ScopeName, SpanAttributes FROM stagetrace.otel_traces"
    ).result_rows
    assert row[:5] == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "Server", "vllm", "vllm.llm_engine")
    assert row[5]["gen_ai.latency.time_in_queue"] == "0.0123" and row[5]["gen_ai.usage.prompt_tokens"] == "512"


def test_a_fully_accepted_request_answers_an_empty_response_in_its_own_encoding(receiver):
    request = ExportTraceServiceRequest()
    status, headers, body = post(f"{receiver.url}/v1/traces", request.SerializeToString(), "application/x-protobuf")
    assert (status, headers["Content-Type"]) == (200, "application/x-protobuf")
    assert ExportTraceServiceResponse.FromString(body) == ExportTraceServiceResponse()
    assert post(f"{receiver.url}/v1/traces", b"{}", "application/json; charset=utf-8")[::2] == (200, b"{}")


def _vllm_protobuf() -> bytes:
    from google.protobuf import json_format

    document = json.loads(VLLM.read_text())
    for span in document["resourceSpans"][0]["scopeSpans"][0]["spans"]:
        for key in ("traceId", "spanId"):
            span[key] = base64.b64encode(bytes.fromhex(span[key])).decode()
    return json_format.ParseDict(document, ExportTraceServiceRequest()).SerializeToString()


@pytest.mark.parametrize(
    "body, content_type, headers, status, message",
    [
        (_vllm_protobuf()[:-9], "application/x-protobuf", {}, 400, "not a valid ExportTraceServiceRequest in protobuf"),
        (b'{"resourceSpans": [', "application/json", {}, 400, "not a valid ExportTraceServiceRequest in OTLP/JSON"),
        (b'{"resourceSpans": 7}', "application/json", {}, 400, "not a valid ExportTraceServiceRequest in OTLP/JSON"),
        (b"spans", "text/plain", {}, 415, "Content-Type text/plain is not OTLP"),
        (b"\0" * (64 * 1024 + 1), "application/x-protobuf", {}, 413, "over the limit of 65536"),
        (
            gzip.compress(b"\0" * (64 * 1024 + 1)),
            "application/x-protobuf",
            {"Content-Encoding": "gzip"},
            413,
            "inflates to over the limit",
        ),
        (b"not gzip", "application/x-protobuf", {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
        (b"x", "application/x-protobuf", {"Content-Encoding": "br"}, 415, "Content-Encoding br is not supported"),
    ],
    ids=[
        "truncated-protobuf",
        "invalid-json",
        "json-of-wrong-shape",
        "wrong-content-type",
        "oversized",
        "gzip-bomb",
        "bad-gzip",
        "unknown-encoding",
    ],
)
def test_malformed_requests_get_the_specified_4xx_and_the_receiver_keeps_serving(
    store, body, content_type, headers, status, message
):
    receiver = OtlpReceiver(store, "127.0.0.1:0", max_body_bytes=64 * 1024)
    try:
        got, answer_headers, answer = post(f"{receiver.url}/v1/traces", body, content_type, **headers)
        assert got == status
        if content_type == "application/json":
            assert message in json.loads(answer)["message"]
        else:  # google.rpc.Status in protobuf: field 2 holds the message
            assert message.encode() in answer
        assert post(f"{receiver.url}/v1/traces", _vllm_protobuf(), "application/x-protobuf")[0] == 200
    finally:
        receiver.close()


def test_other_paths_methods_and_a_missing_token(store):
    receiver = OtlpReceiver(store, "127.0.0.1:0", token="s3cret")
    try:
        url = f"{receiver.url}/v1/traces"
        assert (
            post(f"{receiver.url}/v1/profiles", b"", "application/x-protobuf", Authorization="Bearer s3cret")[0] == 404
        )
        with pytest.raises(urllib.error.HTTPError) as get:
            urllib.request.urlopen(url, timeout=5)
        assert get.value.code == 405 and get.value.headers["Allow"] == "POST"
        status, headers, _ = post(url, b"", "application/x-protobuf")
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
        assert post(url, b"", "application/x-protobuf", Authorization="Bearer wrong")[0] == 401
        assert (
            OTLPSpanExporter(url, headers={"Authorization": "Bearer s3cret"}).export(recorded_spans())
            is SpanExportResult.SUCCESS
        )
        assert OTLPSpanExporter(url, timeout=5).export(recorded_spans()) is SpanExportResult.FAILURE
    finally:
        receiver.close()


def test_a_store_down_without_a_spool_answers_503_with_retry_after_and_keeps_nothing(store):
    # without a spool nothing can hold the spans; with one they go to disk and are answered 200 (tests/test_spool.py)
    receiver = OtlpReceiver(store, "127.0.0.1:0", spool_dir=False)
    insert = store.client.insert

    def failing(*args, **kwargs):
        raise ConnectionError("store down")

    try:
        store.client.insert = failing
        body = _vllm_protobuf()
        status, headers, answer = post(f"{receiver.url}/v1/traces", body, "application/x-protobuf")
        assert status == 503 and headers["Retry-After"] == "2" and b"not taking inserts" in answer
        store.client.insert = insert
        assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 0
        assert post(f"{receiver.url}/v1/traces", body, "application/x-protobuf")[0] == 200  # the sender's retry
        assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 1
    finally:
        store.client.insert = insert
        receiver.close()


def test_gauges_and_sums_from_the_sdk_metric_exporter_land_in_the_collector_tables(store, receiver):
    reader = InMemoryMetricReader()
    provider = MeterProvider(
        resource=Resource.create({"service.name": "vllm", "host.name": "node-a"}), metric_readers=[reader]
    )
    meter = provider.get_meter("vllm.metrics", "0.10.1")
    meter.create_counter("vllm.prompt_tokens", unit="{token}", description="Prompt tokens").add(
        512, {"model_name": "m"}
    )
    meter.create_up_down_counter("vllm.num_requests_running").add(3)
    meter.create_gauge("vllm.kv_cache_usage", unit="1").set(0.42, {"model_name": "m"})
    meter.create_histogram("vllm.e2e_request_latency", unit="s").record(1.29)
    data = reader.get_metrics_data()
    assert OTLPMetricExporter(f"{receiver.url}/v1/metrics").export(data).name == "SUCCESS"
    assert receiver.writer.flush()
    gauge = store.client.query(
        "SELECT MetricName, MetricUnit, Value, Attributes, ServiceName, ScopeName, ScopeVersion, "
        "ResourceAttributes['host.name'] FROM stagetrace.otel_metrics_gauge"
    ).result_rows
    assert gauge == [
        ("vllm.kv_cache_usage", "1", 0.42, {"model_name": "m"}, "vllm", "vllm.metrics", "0.10.1", "node-a")
    ]
    sums = store.client.query(
        "SELECT MetricName, MetricDescription, Value, IsMonotonic, AggregationTemporality "
        "FROM stagetrace.otel_metrics_sum ORDER BY MetricName"
    ).result_rows
    assert sums == [
        ("vllm.num_requests_running", "", 3.0, False, 2),
        ("vllm.prompt_tokens", "Prompt tokens", 512.0, True, 2),
    ]
    # the histogram is not stored, and the answer says so
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    status, _, body = post(
        f"{receiver.url}/v1/metrics", encode_metrics(data).SerializeToString(), "application/x-protobuf"
    )
    answer = ExportMetricsServiceResponse.FromString(body).partial_success
    assert (
        status == 200 and answer.rejected_data_points == 1 and "histogram points are not stored" in answer.error_message
    )
    provider.shutdown()


def test_an_empty_metrics_request_is_accepted(receiver):
    body = ExportMetricsServiceRequest().SerializeToString()
    assert post(f"{receiver.url}/v1/metrics", body, "application/x-protobuf")[0] == 200


def test_the_docs_sdk_snippet_holds_a_burst_of_6000_spans(store):
    """The plain-SDK snippet in docs/otlp.md sizes the SDK's queue: a burst of 6,000 spans made faster than they can
    be sent all reach the store (the SDK's default queue of 2,048 drops what overruns it, out of stagetrace's
    sight). The queue settings are read from the page itself."""
    import re

    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    page = (Path(__file__).resolve().parents[1] / "docs" / "otlp.md").read_text()
    settings = {k: int(v) for k, v in re.findall(r"(max_queue_size|max_export_batch_size)=(\d+)", page)}
    assert settings["max_queue_size"] >= 6000
    receiver = OtlpReceiver(store, "127.0.0.1:0")
    try:
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(f"{receiver.url}/v1/traces"), **settings))
        tracer = provider.get_tracer("burst")
        for _ in range(6000):
            tracer.start_span("burst").end()
        provider.shutdown()
        assert receiver.writer.flush()
        assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 6000
    finally:
        receiver.close()
